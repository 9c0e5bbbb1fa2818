"""The workload's parent, run by the guest's root: the guest side of ``bottles/workload.py``.

argv: the workload's directory, its user (``name[:group]`` or ``uid[:gid]``), then its argv.
It starts the workload as that user (``setgid``/``setuid``), copies the workload's output into
``DIR/log`` (rotated to ``log.1`` at :data:`CAP` bytes), waits for it and writes the exit code
to ``DIR/exit`` itself, where a workload that is not root cannot write. Standard library only:
the kit runs it (``bottlenet-kit workload run``), and where no kit could be built the image's
python3 runs this file's text (``python3 -c``).
"""

import os
import sys
import threading

#: The log's size at which it is rotated (at most twice this much of the guest's RAM).
CAP = 8 * 1024 * 1024
#: The exit code when the user is a name the guest's /etc/passwd lacks.
EXIT_NO_USER = 126


def who(user):
    """(uid, gid) of ``user`` in the guest's /etc/passwd; a number stands for itself."""
    import pwd

    name, _, group = user.partition(":")
    try:
        pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        uid, gid = pw.pw_uid, pw.pw_gid
    except KeyError:
        if not name.isdigit():
            sys.exit(EXIT_NO_USER)
        uid = gid = int(name)
    if group:
        gid = int(group)
    return uid, gid


def copy(d, r):
    log = os.open(d + "/log", os.O_WRONLY | os.O_APPEND)
    size = os.fstat(log).st_size
    while True:
        data = os.read(r, 65536)
        if not data:
            return
        if size + len(data) > CAP:
            os.close(log)
            os.rename(d + "/log", d + "/log.1")
            log = os.open(d + "/log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            size = 0
        os.write(log, data)
        size += len(data)


def main(args):
    d, user, argv = args[0], args[1], args[2:]
    uid, gid = who(user)
    null = os.open(os.devnull, os.O_RDONLY)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(null, 0)
            os.dup2(w, 1)
            os.dup2(w, 2)
            os.close(r)
            os.close(w)
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(w)
    copier = threading.Thread(target=copy, args=(d, r))
    copier.start()
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            pass
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    copier.join(2.0)
    with open(d + "/exit.tmp", "w") as f:
        f.write("%d\n" % code)
    os.rename(d + "/exit.tmp", d + "/exit")
    copier.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
