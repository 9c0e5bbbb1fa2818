#!/bin/sh
# bottlenet isolation probe: run inside an agent VM (through `smolvm machine exec`) before the
# agent's workload starts, and again by `bottlenetctl bottle verify NAME`.
#
# Usage: sh probe.sh [own:ENDPOINT]... [deny:ENDPOINT]... [dns:NAME]...
#   ENDPOINT is tcp:HOST:PORT or unix:PATH.
#   own:  must connect (the bottle's own agent endpoints).
#   deny: must NOT connect within 2 s (raw sidecar ports, other bottles, host services, internet).
#   dns:  NAME must NOT resolve within 2 s.
#
# Needs only sh plus one of python3, nc or curl (tried in that order). Prints one line per
# check ("ok ...", "LEAK ...", "FAIL ...") and a last line "RESULT PASS" or "RESULT FAIL".
# Exit status: 0 pass, 1 a check failed, 3 no usable tool. It reads and writes no payload.

T=2
fail=0

have() { command -v "$1" >/dev/null 2>&1; }

if have python3; then TOOL=python3
elif have nc; then TOOL=nc
elif have curl; then TOOL=curl
else
    echo "FAIL no tool: the probe needs python3, nc or curl in the agent image"
    echo "RESULT FAIL"
    exit 3
fi

# connect KIND ADDR: exit 0 when a connection is established within $T seconds.
connect() {
    kind=$1; addr=$2
    case $TOOL in
    python3)
        python3 - "$kind" "$addr" "$T" <<'EOF'
import socket, sys
kind, addr, t = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = addr
    else:
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        target = (host, int(port))
    s.settimeout(t)
    s.connect(target)
    s.close()
except Exception:
    sys.exit(1)
EOF
        ;;
    nc)
        if [ "$kind" = unix ]; then nc -z -U -w "$T" "$addr" </dev/null >/dev/null 2>&1
        else nc -z -w "$T" "${addr%:*}" "${addr##*:}" </dev/null >/dev/null 2>&1
        fi
        ;;
    curl)
        if [ "$kind" = unix ]; then
            out=$(curl -s -o /dev/null -m "$T" -w '%{time_connect}' --unix-socket "$addr" http://probe/ 2>/dev/null)
        else
            out=$(curl -s -o /dev/null -m "$T" --connect-timeout "$T" -w '%{time_connect}' "telnet://$addr" </dev/null 2>/dev/null)
        fi
        [ -n "$out" ] && [ "$out" != "0.000000" ] && [ "$out" != "0" ]
        ;;
    esac
}

# resolves NAME: exit 0 when NAME resolves within $T seconds.
resolves() {
    case $TOOL in
    python3)
        python3 - "$1" "$T" <<'EOF'
import socket, sys, threading
name, t = sys.argv[1], float(sys.argv[2])
ok = []
def look():
    try:
        socket.getaddrinfo(name, 443)
        ok.append(1)
    except Exception:
        pass
th = threading.Thread(target=look, daemon=True)
th.start()
th.join(t)
sys.exit(0 if ok else 1)
EOF
        ;;
    *)
        if have getent; then
            if have timeout; then timeout "$T" getent hosts "$1" >/dev/null 2>&1
            else getent hosts "$1" >/dev/null 2>&1
            fi
        elif have nslookup; then
            if have timeout; then timeout "$T" nslookup "$1" >/dev/null 2>&1
            else nslookup "$1" >/dev/null 2>&1
            fi
        else
            return 1
        fi
        ;;
    esac
}

for arg in "$@"; do
    case $arg in
    own:tcp:* | own:unix:*)
        ep=${arg#own:}; kind=${ep%%:*}; addr=${ep#*:}
        if connect "$kind" "$addr"; then echo "ok own $ep connects"
        else echo "FAIL own $ep does not connect"; fail=1
        fi
        ;;
    deny:tcp:* | deny:unix:*)
        ep=${arg#deny:}; kind=${ep%%:*}; addr=${ep#*:}
        if connect "$kind" "$addr"; then echo "LEAK $ep is reachable"; fail=1
        else echo "ok blocked $ep"
        fi
        ;;
    dns:*)
        name=${arg#dns:}
        if resolves "$name"; then echo "LEAK dns $name resolves"; fail=1
        else echo "ok blocked dns $name"
        fi
        ;;
    *)
        echo "FAIL bad probe argument"; fail=1
        ;;
    esac
done

if [ "$fail" = 0 ]; then echo "RESULT PASS"; exit 0; fi
echo "RESULT FAIL"
exit 1
