/* NCCL 2.29 entry points that torch 2.13 links against and the GPU hosts' NCCL 2.28.9 (torch 2.11's pin) lacks.
 *
 * torch 2.13.0+cu130 pins nvidia-nccl-cu13==2.29.7, which the package registry does not carry (it has 2.27.7
 * and 2.32.3; 2.32.3 is 291 MiB, five chunks). libtorch_cuda.so references these symbols directly, and Python
 * loads it with RTLD_NOW, so `import torch` fails on 2.28.9 with "undefined symbol: ncclCommSuspend" although
 * nothing colo or vLLM runs calls them: communicator suspend/resume and its memory statistics (NCCL 2.29,
 * torch's backend.suspend()/resume()), and the one-sided signal / peer-pointer calls of torch's NCCL symmetric
 * memory backend. Preloaded (LD_PRELOAD, set by device-install.sh only when the host's libnccl lacks one of
 * them), each answers ncclInvalidUsage (5), so a caller gets an NCCL error instead of a crash.
 * vLLM's own NCCL wrapper asks libnccl's handle (dlsym), not the global scope, so it still sees them as absent.
 * Built without libc (-nostdlib): it depends on no glibc version. */
#define NCCL_INVALID_USAGE 5
int ncclCommSuspend(void *comm, int flags) { return NCCL_INVALID_USAGE; }
int ncclCommResume(void *comm) { return NCCL_INVALID_USAGE; }
int ncclCommMemStats(void *comm, int stat, void *value) { return NCCL_INVALID_USAGE; }
int ncclGetLsaMultimemDevicePointer(void *win, unsigned long off, void **ptr) { return NCCL_INVALID_USAGE; }
int ncclGetPeerDevicePointer(void *win, unsigned long off, int peer, void **ptr) { return NCCL_INVALID_USAGE; }
int ncclPutSignal(const void *a, unsigned long b, int c, int d, void *e, unsigned long f, int g, unsigned int h,
                  void *i, void *j) { return NCCL_INVALID_USAGE; }
int ncclSignal(int peer, int sig, unsigned int ctx, unsigned int flags, void *comm, void *stream) {
  return NCCL_INVALID_USAGE;
}
int ncclWaitSignal(int n, void *desc, void *comm, void *stream) { return NCCL_INVALID_USAGE; }
