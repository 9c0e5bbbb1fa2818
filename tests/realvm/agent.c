/* /init, PID 1 of the real-VM tier's kit guests: a stand-in for smolvm's guest agent.
 *
 * smolvm's agent is a static program that sets up the guest's mounts and runs each
 * `machine exec` it is sent; a guest image needs no shell for it. This one does the same for
 * a fixed list of steps (/rvm/steps), so a guest with no shell at all can be driven: it
 * mounts /proc, /sys, /dev, a tmpfs /run and /tmp, and the kit (/kit of the root disk, bound
 * read-only) at /run/bottlenet-kit, as smolvm mounts it, then runs each step. Step lines, words separated by tabs:
 *
 *   bg    ARGV...        started with stdin a pipe kept open, output to the transcript
 *   unix  PATH           waits (30 s at most) until PATH exists
 *   tcp   PORT           waits (30 s at most) until 127.0.0.1:PORT accepts
 *   run   LABEL STDIN ARGV...  runs it (STDIN a file, or - for /dev/null), its output to the
 *                        transcript, and says "RVM-STEP LABEL exit <code> <ms>" on the console
 *   env   NAME=VALUE     set for the steps after it
 *   unenv NAME           unset for the steps after it
 *   up    LINK ADDR MASK brings LINK up with the IPv4 ADDR/MASK, by ioctl as libkrun's init
 *                        does for dummy0 when its transparent socket impersonation is on
 *                        (tsi_hijack; 203.0.113.1/255.255.255.0 in smolmachines 1.32.2 and
 *                        1.37.3); says "RVM-UP LINK ok" or "RVM-UP LINK failed <errno>"
 *
 * The transcript is the virtio port named "transcript"; the console is /dev/console (hvc0).
 * At the end: "RVM-DONE", sync, power off.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int console = 2, transcript = -1;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    buf[n++] = '\n';
    if (write(console, buf, n) < 0) {}
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int open_port(const char *want) {
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    char path[512], name[64];
    if (!d) return -1;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t n = read(fd, name, sizeof name - 1);
        close(fd);
        if (n <= 0) continue;
        name[n] = 0;
        if (name[n - 1] == '\n') name[n - 1] = 0;
        if (strcmp(name, want) == 0) {
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            closedir(d);
            return open(path, O_WRONLY | O_CLOEXEC);
        }
    }
    closedir(d);
    return -1;
}

static pid_t start(char **argv, int in) {
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in, 0);
        dup2(transcript >= 0 ? transcript : console, 1);
        dup2(transcript >= 0 ? transcript : console, 2);
        execv(argv[0], argv);
        say("RVM-EXEC-FAILED %s: %s", argv[0], strerror(errno));
        _exit(127);
    }
    return pid;
}

static int wait_for(int (*ready)(const char *), const char *what) {
    for (int i = 0; i < 300; i++) {
        if (ready(what)) return 1;
        usleep(100000);
    }
    say("RVM-WAIT-FAILED %s", what);
    return 0;
}

static int unix_ready(const char *path) { struct stat st; return stat(path, &st) == 0; }

static int tcp_ready(const char *port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int ok = connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    close(s);
    return ok;
}

static void setup(void) {
    mount("proc", "/proc", "proc", 0, NULL);
    mount("sys", "/sys", "sysfs", 0, NULL);
    mount("dev", "/dev", "devtmpfs", 0, NULL);
    mount("run", "/run", "tmpfs", 0, "mode=0755");
    mount("tmp", "/tmp", "tmpfs", 0, "mode=1777");
    mkdir("/run/bottlenet-kit", 0755);
    if (mount("/kit", "/run/bottlenet-kit", NULL, MS_BIND, NULL) != 0 ||
        mount(NULL, "/run/bottlenet-kit", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) != 0)
        say("RVM-KIT-MOUNT-FAILED %s", strerror(errno));
    mkdir("/run/bottle", 0755);
    int fd = open("/dev/console", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) console = fd;
    transcript = open_port("transcript");
    /* loopback up: SIOCSIFFLAGS without a tool */
    struct { char name[16]; short flags; char pad[22]; } ifr = {"lo", 0, {0}};
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (ioctl(s, 0x8913 /* SIOCGIFFLAGS */, &ifr) == 0) {
        ifr.flags |= 1; /* IFF_UP */
        ioctl(s, 0x8914 /* SIOCSIFFLAGS */, &ifr);
    }
    close(s);
}

static void link_up(const char *name, const char *addr, const char *mask) {
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", name);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    const char *failed = NULL;
    if (ioctl(s, SIOCGIFFLAGS, &ifr) != 0) failed = "flags";
    ifr.ifr_flags |= IFF_UP;
    if (!failed && ioctl(s, SIOCSIFFLAGS, &ifr) != 0) failed = "up";
    memset(&ifr.ifr_addr, 0, sizeof ifr.ifr_addr);
    sin->sin_family = AF_INET;
    inet_pton(AF_INET, addr, &sin->sin_addr);
    if (!failed && ioctl(s, SIOCSIFADDR, &ifr) != 0) failed = "address";
    inet_pton(AF_INET, mask, &sin->sin_addr);
    if (!failed && ioctl(s, SIOCSIFNETMASK, &ifr) != 0) failed = "mask";
    close(s);
    if (failed) say("RVM-UP %s failed %s %s", name, failed, strerror(errno));
    else say("RVM-UP %s ok", name);
}

int main(void) {
    setup();
    say("RVM-INIT kernel up, agent running");
    FILE *f = fopen("/rvm/steps", "r");
    char line[4096];
    int keep[2];
    if (pipe2(keep, O_CLOEXEC) != 0) return 1;
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *argv[64];
        int n = 0;
        for (char *w = strtok(line, "\t"); w && n < 63; w = strtok(NULL, "\t")) argv[n++] = w;
        argv[n] = NULL;
        if (n < 2) continue;
        if (strcmp(argv[0], "env") == 0) {
            putenv(strdup(argv[1]));
        } else if (strcmp(argv[0], "unenv") == 0) {
            unsetenv(argv[1]);
        } else if (strcmp(argv[0], "up") == 0 && n >= 4) {
            link_up(argv[1], argv[2], argv[3]);
        } else if (strcmp(argv[0], "bg") == 0) {
            start(argv + 1, keep[0]);
        } else if (strcmp(argv[0], "unix") == 0) {
            wait_for(unix_ready, argv[1]);
        } else if (strcmp(argv[0], "tcp") == 0) {
            wait_for(tcp_ready, argv[1]);
        } else if (strcmp(argv[0], "run") == 0 && n >= 4) {
            int in = open(strcmp(argv[2], "-") ? argv[2] : "/dev/null", O_RDONLY | O_CLOEXEC);
            double t0 = now_ms();
            pid_t pid = start(argv + 3, in);
            int status = 0;
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
            int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            say("RVM-STEP %s exit %d %.0f", argv[1], code, now_ms() - t0);
            if (in >= 0) close(in);
        }
    }
    say("RVM-DONE");
    sync();
    reboot(RB_AUTOBOOT); /* with reboot=t and QEMU's -no-reboot: QEMU exits */
    return 0;
}
