#!/bin/sh
# /init of the real-VM tier's guest (busybox sh). The per-run /rvm.conf (appended to the
# initramfs) says how this guest is built: NET (none, leaky, nsonly, restricted), SHARES
# (9p mounts "tag:guestpath[:ro]"), BLIND (1: python3 cannot connect). The probe script is
# /probe.sh, run exactly as the daemon runs it (sh -s on stdin); its output goes to ttyS1.
/bin/busybox mkdir -p /usr/bin /usr/sbin /sbin
/bin/busybox --install -s
export PATH=/usr/bin:/bin:/usr/sbin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o mode=0755 run /run
. /rvm.conf
while read -r m; do  # in dependency order (build.py)
    insmod "/lib/modules/$m" 2>&1 | sed "s/^/RVM-INSMOD $m: /"
done < /lib/modules/order
ip link set lo up
hostname rvm-guest
case "$NET" in
leaky)
    ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2
    echo "nameserver 10.0.2.3" > /etc/resolv.conf ;;
nsonly)
    ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0
    echo "nameserver 10.0.2.2" > /etc/resolv.conf ;;
restricted)
    ip link set eth0 up ;;
esac
for s in $SHARES; do
    tag=${s%%:*}; rest=${s#*:}; path=${rest%%:*}; opts=trans=virtio,version=9p2000.L
    [ "${rest##*:}" = ro ] && opts=$opts,ro
    mkdir -p "$path" && mount -t 9p -o "$opts" "$tag" "$path" || echo "RVM-MOUNT-FAILED $tag"
done
mkdir -p /run/bottle
python3 -I -S /relay.py /run/bottle/egress.sock egress &
i=0
while [ ! -S /run/bottle/egress.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
# With a NIC, the kernel takes an IPv6 default route from slirp's router advertisement (a
# second or two after eth0 came up); the gate must find that path, so the probe waits for it.
if [ "$NET" != none ]; then
    i=0
    while ! grep -q '^0\{32\} 00 .* eth0$' /proc/net/ipv6_route && [ $i -lt 100 ]; do
        sleep 0.1; i=$((i + 1))
    done
fi
if [ "$BLIND" = 1 ]; then
    mkdir -p /blind && cp /blind-python3 /blind/python3 && export PATH=/blind:$PATH
fi
echo "RVM-IFACES $(ls /sys/class/net | tr '\n' ' ')"
echo "RVM-PROBE-START $(cut -d' ' -f1 /proc/uptime)"
sh -s < /probe.sh > /dev/ttyS1 2>/dev/null
rc=$?
echo "RVM-PROBE-END $(cut -d' ' -f1 /proc/uptime)"
echo "RVM-EXIT $rc"
sync
poweroff -f
