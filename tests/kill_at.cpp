// LD_PRELOAD shim for kill campaigns: the process SIGKILLs itself just before its Nth call
// (SIGMA_KILL_AT=N) that changes the filesystem's names or creates a file: mkdir, rename,
// link, unlink, rmdir, remove, and open/fopen for writing. Every such call is one point where
// a kill can leave a different state on disk, so N = 1, 2, ... until the process finishes
// untouched visits every point of a run. SIGMA_KILL_COUNT=FILE writes the number of calls
// made at exit (how many points there are). Nothing is counted without either variable.
// SIGMA_FAIL_OPEN=TEXT: instead of a kill, every open/fopen for writing of a path containing
// TEXT fails with ENOSPC ("No space left on device"): a full disk for those files only.
// SIGMA_SLOW_OPEN=TEXT: every open/fopen for writing of a path containing TEXT first sleeps
// SIGMA_SLOW_MS milliseconds (default 500): a slow disk for those files, so that a background
// save is still being written when the next steps run.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static long g_at = -1;
static long g_calls;  // atomic: OpenMP threads may write too
static const char* g_count_file;
static const char* g_fail_open;  // SIGMA_FAIL_OPEN
static const char* g_slow_open;  // SIGMA_SLOW_OPEN
static long g_slow_ms = 500;     // SIGMA_SLOW_MS

extern "C" {

static void write_count(void) {
  auto real_fopen = reinterpret_cast<FILE* (*)(const char*, const char*)>(dlsym(RTLD_NEXT, "fopen"));
  FILE* f = real_fopen(g_count_file, "w");
  if (f) fprintf(f, "%ld\n", __atomic_load_n(&g_calls, __ATOMIC_SEQ_CST)), fclose(f);
}

__attribute__((constructor)) static void init(void) {
  const char* at = getenv("SIGMA_KILL_AT");
  if (at) g_at = atol(at);
  g_count_file = getenv("SIGMA_KILL_COUNT");
  g_fail_open = getenv("SIGMA_FAIL_OPEN");
  if (g_fail_open && !*g_fail_open) g_fail_open = nullptr;
  g_slow_open = getenv("SIGMA_SLOW_OPEN");
  if (g_slow_open && !*g_slow_open) g_slow_open = nullptr;
  if (const char* ms = getenv("SIGMA_SLOW_MS")) g_slow_ms = atol(ms);
  if (g_count_file) atexit(write_count);
  // Children (mpirun, python) must not inherit the count.
  unsetenv("LD_PRELOAD");
}

static void point(void) {
  if (g_at < 0 && !g_count_file) return;
  const long n = __atomic_add_fetch(&g_calls, 1, __ATOMIC_SEQ_CST);
  if (n == g_at) kill(getpid(), SIGKILL);
}

#define REAL(name) (reinterpret_cast<decltype(&::name)>(dlsym(RTLD_NEXT, #name)))

int mkdir(const char* p, mode_t m) { point(); return REAL(mkdir)(p, m); }
int mkdirat(int d, const char* p, mode_t m) { point(); return REAL(mkdirat)(d, p, m); }
int rename(const char* a, const char* b) { point(); return REAL(rename)(a, b); }
int renameat(int da, const char* a, int db, const char* b) { point(); return REAL(renameat)(da, a, db, b); }
int renameat2(int da, const char* a, int db, const char* b, unsigned f) {
  point();
  return REAL(renameat2)(da, a, db, b, f);
}
int link(const char* a, const char* b) { point(); return REAL(link)(a, b); }
int unlink(const char* p) { point(); return REAL(unlink)(p); }
int unlinkat(int d, const char* p, int f) { point(); return REAL(unlinkat)(d, p, f); }
int rmdir(const char* p) { point(); return REAL(rmdir)(p); }
int remove(const char* p) { point(); return REAL(remove)(p); }

static int writes(int flags) { return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0; }
// True (errno ENOSPC) when a write-open of `p` is to fail (SIGMA_FAIL_OPEN); first the delay
// of SIGMA_SLOW_OPEN.
static int refused(const char* p) {
  if (g_slow_open && p && strstr(p, g_slow_open)) usleep(useconds_t(g_slow_ms) * 1000);
  if (!g_fail_open || !p || !strstr(p, g_fail_open)) return 0;
  errno = ENOSPC;
  return 1;
}

#define OPEN_MODE(flags) \
  mode_t mode = 0;       \
  if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = mode_t(va_arg(ap, int)); va_end(ap); }

int open(const char* p, int flags, ...) {
  OPEN_MODE(flags)
  if (writes(flags)) point();
  if (writes(flags) && refused(p)) return -1;
  return REAL(open)(p, flags, mode);
}
int open64(const char* p, int flags, ...) {
  OPEN_MODE(flags)
  if (writes(flags)) point();
  if (writes(flags) && refused(p)) return -1;
  return REAL(open64)(p, flags, mode);
}
int openat(int d, const char* p, int flags, ...) {
  OPEN_MODE(flags)
  if (writes(flags)) point();
  if (writes(flags) && refused(p)) return -1;
  return REAL(openat)(d, p, flags, mode);
}
int openat64(int d, const char* p, int flags, ...) {
  OPEN_MODE(flags)
  if (writes(flags)) point();
  if (writes(flags) && refused(p)) return -1;
  return REAL(openat64)(d, p, flags, mode);
}
FILE* fopen(const char* p, const char* m) {
  if (m[0] != 'r' || strchr(m, '+')) {
    point();
    if (refused(p)) return nullptr;
  }
  return REAL(fopen)(p, m);
}
FILE* fopen64(const char* p, const char* m) {
  if (m[0] != 'r' || strchr(m, '+')) {
    point();
    if (refused(p)) return nullptr;
  }
  return REAL(fopen64)(p, m);
}

}  // extern "C"
