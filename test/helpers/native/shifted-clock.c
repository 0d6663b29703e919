/*
 * A wall clock CLOCK_SHIFT_MS ahead for the process it is preloaded into (LD_PRELOAD): a Redis
 * and the gateways of one test set a few seconds before a billing-day boundary, so the boundary
 * passes inside the run. The monotonic clocks are left alone (timers, timeouts, Redis's event
 * loop). libfaketime does this, but not for Debian's redis-server: its jemalloc asks the time
 * while libfaketime starts, and it refuses to start (0.9.10). Here the time comes from the
 * system call itself, so nothing is asked back.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_ms(void) {
  static long long shift = -1; /* read once; threads that race here read the same value */
  if (shift < 0) {
    const char *s = getenv("CLOCK_SHIFT_MS");
    shift = s ? atoll(s) : 0;
    if (shift < 0) shift = 0;
  }
  return shift;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
  int r = (int)syscall(SYS_clock_gettime, id, ts);
  if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    long long ms = shift_ms();
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000;
    if (ts->tv_nsec >= 1000000000) {
      ts->tv_sec += 1;
      ts->tv_nsec -= 1000000000;
    }
  }
  return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
  (void)tz;
  struct timespec ts;
  int r = clock_gettime(CLOCK_REALTIME, &ts);
  if (r == 0) {
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  return r;
}

time_t time(time_t *out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out) *out = ts.tv_sec;
  return ts.tv_sec;
}
