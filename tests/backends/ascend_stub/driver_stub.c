/* A stand-in for the Ascend NPU driver and CANN runtime, for running the real
 * memcache_hybrid / memfabric_hybrid libraries on a host without an NPU.
 *
 * Those libraries dlopen libascendcl.so, libascend_hal.so, libra.so, libtsdclient.so,
 * libhccl.so and libdcmi.so and look their entry points up by name. This one library is
 * installed under all of those names (tests/backends/ascend_stub/sandbox.sh). Every
 * entry point they look up exists: most are no-ops returning 0 (success), device memory
 * is host memory, and copies of any direction are memcpy. It is enough for the host
 * protocols (host_shm, host_tcp), whose data never touches an NPU; nothing here
 * stands for the device protocols (device_rdma, device_sdma, ...), which need hardware.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOOP(name) int name(void) { return 0; }

static int32_t g_device = 0;
static char g_token; /* the address handed out as a stream, context or notify handle */

static void *host_alloc(size_t size) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, size ? size : 1) != 0) return NULL;
    memset(p, 0, size);
    return p;
}

/* ---- memory ---- */
int aclrtMalloc(void **p, size_t size, int policy) { (void)policy; *p = host_alloc(size); return *p ? 0 : 1; }
int aclrtMallocHost(void **p, size_t size) { *p = host_alloc(size); return *p ? 0 : 1; }
int halMemAlloc(void **p, unsigned long long size, unsigned long long flag) {
    (void)flag; *p = host_alloc(size); return *p ? 0 : 1;
}
/* Freed memory is leaked on purpose: a caller may hand back an address we never
 * allocated (a registration, a mapping), and freeing that would corrupt the heap. */
int aclrtFree(void *p) { (void)p; return 0; }
int aclrtFreeHost(void *p) { (void)p; return 0; }
int halMemFree(void *p) { (void)p; return 0; }

int aclrtMemcpy(void *dst, size_t dmax, const void *src, size_t n, int kind) {
    (void)dmax; (void)kind; if (n) memmove(dst, src, n); return 0;
}
int aclrtMemcpyAsync(void *dst, size_t dmax, const void *src, size_t n, int kind, void *stream) {
    (void)stream; return aclrtMemcpy(dst, dmax, src, n, kind);
}
int aclrtMemcpy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                  size_t height, int kind) {
    (void)kind;
    for (size_t r = 0; r < height; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return 0;
}
int aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                       size_t height, int kind, void *stream) {
    (void)stream; return aclrtMemcpy2d(dst, dpitch, src, spitch, width, height, kind);
}
int aclrtMemcpyBatch(void **dsts, size_t *dmax, void **srcs, size_t *sizes, size_t n,
                     void *attrs, size_t *attr_idx, size_t n_attrs, size_t *fail_idx) {
    (void)dmax; (void)attrs; (void)attr_idx; (void)n_attrs;
    for (size_t i = 0; i < n; i++) if (sizes[i]) memmove(dsts[i], srcs[i], sizes[i]);
    if (fail_idx) *fail_idx = (size_t)-1;
    return 0;
}
int rtMemcpyAsyncWithoutCheckKind(void *dst, uint64_t dmax, const void *src, uint64_t n, int kind,
                                  void *stream) {
    (void)dmax; (void)kind; (void)stream; if (n) memmove(dst, src, n); return 0;
}
int aclrtMemset(void *p, size_t max, int32_t value, size_t n) { (void)max; memset(p, value, n); return 0; }

/* Registering host memory maps it at the same address. */
int halHostRegister(void *src, uint64_t size, uint32_t flag, uint32_t dev, void **dst) {
    (void)size; (void)flag; (void)dev; if (dst) *dst = src; return 0;
}
/* CANN's registration of existing host memory (aclrtHostRegisterV2: three arguments):
 * the device address of registered memory is its host address; unregistered memory has
 * none (NULL, as the real runtime answers), so a caller that skipped registering fails. */
#ifndef NO_HOST_REGISTER /* -DNO_HOST_REGISTER: a CANN without host registration */
#define MAX_REGISTERED 64
static void *g_registered[MAX_REGISTERED];
int aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag) {
    (void)size; (void)flag;
    for (int i = 0; i < MAX_REGISTERED; i++) if (!g_registered[i]) { g_registered[i] = ptr; return 0; }
    return 207001; /* ACL_ERROR_RT_MEMORY_ALLOCATION */
}
int aclrtHostGetDevicePointer(void *host, void **dev, uint32_t flag) {
    (void)flag; *dev = NULL;
    for (int i = 0; i < MAX_REGISTERED; i++) if (g_registered[i] == host) *dev = host;
    return 0;
}
int aclrtHostUnregister(void *ptr) {
    for (int i = 0; i < MAX_REGISTERED; i++) if (g_registered[i] == ptr) { g_registered[i] = NULL; return 0; }
    return 107000; /* ACL_ERROR_RT_PARAM_INVALID */
}
#endif
int halMemGetAllocationGranularity(void *prop, int option, size_t *g) {
    (void)prop; (void)option; *g = 2u << 20; return 0;
}

/* ---- device, streams, versions ---- */
int aclrtSetDevice(int32_t dev) { g_device = dev; return 0; }
int aclrtGetDevice(int32_t *dev) { *dev = g_device; return 0; }
const char *aclrtGetSocName(void) { return "Ascend910B1"; }
int aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    *major = 1; *minor = 0; *patch = 0; return 0;
}
int aclsysGetVersionStr(const char *pkg, char *out) { (void)pkg; strcpy(out, "8.3.RC1"); return 0; }
int aclrtCreateStream(void **s) { *s = &g_token; return 0; }
int aclrtCreateStreamWithConfig(void **s, uint32_t prio, uint32_t flag) { (void)prio; (void)flag; *s = &g_token; return 0; }
int aclrtGetCurrentContext(void **c) { *c = &g_token; return 0; }
int aclrtCreateNotify(void **n, uint64_t flag) { (void)flag; *n = &g_token; return 0; }
int aclrtGetPhyDevIdByLogicDevId(int32_t logic, int32_t *phy) { *phy = logic; return 0; }
int rtGetLogicDevIdByUserDevId(int32_t user, int32_t *logic) { *logic = user; return 0; }
int rtDeviceGetBareTgid(uint32_t *pid) { *pid = (uint32_t)getpid(); return 0; }
int rtGetDeviceInfo(uint32_t dev, int32_t module, int32_t info, int64_t *val) {
    (void)dev; (void)module; (void)info; *val = 0; return 0;
}

/* ---- everything else the libraries look up: no-ops ---- */
NOOP(aclCreateTensor) NOOP(aclDestroyTensor) NOOP(aclnnShmemSdmaStarsQuery)
NOOP(aclnnShmemSdmaStarsQueryGetWorkspaceSize) NOOP(aclrtBinaryGetFunction) NOOP(aclrtBinaryLoadFromFile)
NOOP(aclrtDestroyNotify) NOOP(aclrtDestroyStream) NOOP(aclrtDeviceEnablePeerAccess) NOOP(aclrtGetNotifyId)
NOOP(aclrtKernelArgsAppend) NOOP(aclrtKernelArgsFinalize) NOOP(aclrtKernelArgsInit)
NOOP(aclrtLaunchKernelWithConfig) NOOP(aclrtSetStreamAttribute) NOOP(aclrtStreamAbort) NOOP(aclrtStreamGetId)
NOOP(aclrtSynchronizeStream) NOOP(aclrtWaitAndResetNotify)
NOOP(DcmiGetAffinityCpuInfo) NOOP(dcmiv2_get_affinity_cpu_info_by_dev_id) NOOP(dcmiv2_get_device_pcie_info)
NOOP(dcmiv2_get_eid_list_by_urma_dev_index) NOOP(dcmiv2_get_urma_device_cnt) NOOP(dcmiv2_init)
NOOP(HcclCommDestroy) NOOP(HcclCommInitClusterInfoMemConfig) NOOP(TsdOpen)
NOOP(drvMemGetAttribute) NOOP(drvNotifyIdAddrOffset) NOOP(halCqReportRecv) NOOP(halHostUnregisterEx)
NOOP(halMemAddressFree) NOOP(halMemAddressReserve) NOOP(halMemCreate) NOOP(halMemExportToShareableHandleV2)
NOOP(halMemImportFromShareableHandleV2) NOOP(halMemMap) NOOP(halMemRelease) NOOP(halMemRetainAllocationHandle)
NOOP(halMemSetAccess) NOOP(halMemShareHandleSetAttribute) NOOP(halMemTransShareableHandle) NOOP(halMemUnmap)
NOOP(halResourceConfig) NOOP(halResourceDetailQuery) NOOP(halResourceIdAlloc) NOOP(halResourceIdFree)
NOOP(halSqCqAllocate) NOOP(halSqCqFree) NOOP(halSqCqQuery) NOOP(halSqTaskSend)
NOOP(rtDisableP2P) NOOP(rtEnableP2P) NOOP(rtGetDevResAddress) NOOP(rtGetP2PStatus) NOOP(rtIpcCloseMemory)
NOOP(rtIpcDestroyMemoryName) NOOP(rtIpcOpenMemory) NOOP(rtIpcSetMemoryName) NOOP(rtSetIpcMemorySuperPodPid)
NOOP(rtStreamGetCqid) NOOP(rtStreamGetSqid)
NOOP(RaAiQpCreate) NOOP(RaDeregisterMr) NOOP(RaGetIfaddrs) NOOP(RaGetIfnum) NOOP(RaGetNotifyBaseAddr)
NOOP(RaGetNotifyMrInfo) NOOP(RaGetQpStatus) NOOP(RaGetSockets) NOOP(RaInit) NOOP(RaQpConnectAsync)
NOOP(RaQpCreate) NOOP(RaQpCreateWithAttrs) NOOP(RaQpDestroy) NOOP(RaRdevGetHandle) NOOP(RaRdevInit)
NOOP(RaRdevInitV2) NOOP(RaRegisterMr) NOOP(RaSendWr) NOOP(RaSendWrV2) NOOP(RaSetQpAttrQos)
NOOP(RaSocketBatchClose) NOOP(RaSocketBatchConnect) NOOP(RaSocketBatchConnectLegacy) NOOP(RaSocketDeinit)
NOOP(RaSocketInit) NOOP(RaSocketListenStart) NOOP(RaSocketListenStop) NOOP(RaSocketWhiteListAdd)
NOOP(RaSocketWhiteListDel)
NOOP(ra_ai_qp_create) NOOP(ra_deregister_mr) NOOP(ra_get_ifaddrs) NOOP(ra_get_ifnum)
NOOP(ra_get_notify_base_addr) NOOP(ra_get_notify_mr_info) NOOP(ra_get_qp_status) NOOP(ra_get_sockets)
NOOP(ra_init) NOOP(ra_qp_connect_async) NOOP(ra_qp_create) NOOP(ra_qp_create_with_attrs) NOOP(ra_qp_destroy)
NOOP(ra_rdev_get_handle) NOOP(ra_rdev_init_v2) NOOP(ra_register_mr) NOOP(ra_send_wr) NOOP(ra_send_wr_v2)
NOOP(ra_set_qp_attr_qos) NOOP(ra_socket_batch_close) NOOP(ra_socket_batch_connect) NOOP(ra_socket_deinit)
NOOP(ra_socket_init) NOOP(ra_socket_listen_start) NOOP(ra_socket_listen_stop) NOOP(ra_socket_white_list_add)
NOOP(ra_socket_white_list_del)
