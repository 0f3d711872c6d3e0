/* fake_nvml.c - a small stand-in for libnvidia-ml.so.1, driven through pynvml's real ctypes path.
 *
 * Values come from the key=value file named by $FAKE_NVML_CONFIG, re-read on EVERY call, so a test
 * changes a GPU mid-run by rewriting the file. The format is documented in
 * tests/support/fake_nvml.py (which also builds this file). In short:
 *     count=8                     init_error=9            driver_version=550.54.15
 *     gpu3.remapped_rows.error=3  (per-function error)    gpu0.temperature.sleep_ms=2000 (hang)
 *     gpu5.lost=1                 (every call on GPU 5, handle lookup included, returns 15)
 *
 * Only the symbols healthd's collector calls through nvidia-ml-py 13.615.71 exist: pynvml resolves
 * symbols lazily, so a missing one is NVMLError_FunctionNotFound at call time. To build a library
 * WITHOUT a symbol (old driver), rename it away at compile time:
 *     -DnvmlDeviceGetRemappedRows=omitted_nvmlDeviceGetRemappedRows
 * pynvml sets no argtypes, so a wrong signature here corrupts memory silently: compile once with
 * -DREAL_NVML_H -I<nvml.h dir> (pip download nvidia-nvml-dev-cu12) to type-check against NVIDIA's
 * header. The default build needs no header.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef REAL_NVML_H
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#else
typedef int nvmlReturn_t;
typedef int nvmlTemperatureSensors_t, nvmlTemperatureThresholds_t, nvmlMemoryErrorType_t,
    nvmlEccCounterType_t, nvmlPageRetirementCause_t, nvmlEnableState_t, nvmlNvLinkErrorCounter_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t; /* 68 bytes, pynvml's nvmlPciInfo_t */
typedef struct { unsigned int version; int marginTemperature; } nvmlMarginTemperature_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* pynvml's c_nvmlProcessInfo_v3_t (the same as v2) */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t; /* pynvml's c_nvmlFieldValue_t */
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_FI_DEV_NVLINK_GET_STATE 165
/* NVML return codes used here (values from nvml.h). */
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999
#define nvmlMarginTemperature_v1 (unsigned int)(sizeof(nvmlMarginTemperature_t) | (1 << 24U))
#endif

/* The layouts pynvml's ctypes structures assume (checked against nvml.h with -DREAL_NVML_H). */
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t (v3) must be 68 bytes");
_Static_assert(sizeof(nvmlMarginTemperature_t) == 8, "nvmlMarginTemperature_v1_t is 8 bytes");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t (v2/v3) is 24 bytes");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t is 40 bytes");

#define MAX_GPUS 64
#define CFG_MAX 65536

/* Handles are stable pointers into this array; a handle's GPU index is its offset. */
struct nvmlDevice_st { int unused; };
static struct nvmlDevice_st devices[MAX_GPUS];
static int init_refcount; /* nvmlInit/nvmlShutdown nest, as in the real library */
static int init_calls;    /* successful nvmlInit calls, for tests of re-initialisation */

/* ------------------------------------------------------------------ call counts */

/* With $FAKE_NVML_CALLS naming a file of CALL_SLOTS zeroed call_slot_t records (made by
 * tests/support/fake_nvml.py:CallCounter), every call adds one to its function's record through a
 * shared mapping, so another process (a benchmark watching a running agent) reads the counts while
 * the agent runs, without a write() per call. Records are claimed in call order. */
#define CALL_SLOTS 64
typedef struct { char name[56]; unsigned long long calls; } call_slot_t;
static call_slot_t *call_slots;
static int call_slots_tried;

static void count_call(const char *fn) {
    if (!call_slots_tried) {
        const char *path = getenv("FAKE_NVML_CALLS");
        int fd = path ? open(path, O_RDWR | O_CLOEXEC) : -1;
        call_slots_tried = 1;
        if (fd >= 0) {
            void *m = mmap(NULL, CALL_SLOTS * sizeof(call_slot_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (m != MAP_FAILED) call_slots = m;
        }
    }
    if (!call_slots) return;
    for (int i = 0; i < CALL_SLOTS; i++) {
        if (!call_slots[i].name[0]) snprintf(call_slots[i].name, sizeof call_slots[i].name, "%s", fn);
        if (strcmp(call_slots[i].name, fn) == 0) {
            __atomic_add_fetch(&call_slots[i].calls, 1, __ATOMIC_RELAXED);
            return;
        }
    }
}

/* ------------------------------------------------------------------ config file */

typedef struct { char text[CFG_MAX]; } cfg_t;

static void cfg_load(cfg_t *c) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    size_t n = f ? fread(c->text, 1, CFG_MAX - 1, f) : 0;
    c->text[n] = '\0';
    if (f) fclose(f);
}

/* The value of `key` (last occurrence wins), copied into out; NULL when absent. */
static const char *cfg_get(const cfg_t *c, const char *key, char *out, size_t outlen) {
    const char *found = NULL, *line = c->text;
    size_t klen = strlen(key);
    while (*line) {
        const char *end = strchr(line, '\n');
        if (!end) end = line + strlen(line);
        if ((size_t)(end - line) > klen && strncmp(line, key, klen) == 0 && line[klen] == '=') {
            size_t vlen = (size_t)(end - line) - klen - 1;
            if (vlen >= outlen) vlen = outlen - 1;
            memcpy(out, line + klen + 1, vlen);
            out[vlen] = '\0';
            while (vlen && (out[vlen - 1] == '\r' || out[vlen - 1] == ' ')) out[--vlen] = '\0';
            found = out;
        }
        line = *end ? end + 1 : end;
    }
    return found;
}

/* gpu < 0 looks up a global key, otherwise "gpu<N>.<key>". */
static long long cfg_int(const cfg_t *c, int gpu, const char *key, long long dflt) {
    char full[128], val[64];
    if (gpu >= 0) snprintf(full, sizeof full, "gpu%d.%s", gpu, key);
    else snprintf(full, sizeof full, "%s", key);
    return cfg_get(c, full, val, sizeof val) ? strtoll(val, NULL, 0) : dflt;
}

static const char *cfg_str(const cfg_t *c, int gpu, const char *key, char *out, size_t n,
                           const char *dflt) {
    char full[128];
    snprintf(full, sizeof full, "gpu%d.%s", gpu, key);
    if (cfg_get(c, full, out, n)) return out;
    snprintf(out, n, "%s", dflt);
    return out;
}

static void sleep_ms(long long ms) {
    if (ms <= 0) return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Common prologue of every call: load the config, then apply, in this order, the configured
 * sleep (a hung driver call), init state, the GPU's `lost` flag and a per-function error code.
 * gpu < 0 is a system call; fn is the short name used in "<fn>.error" / "<fn>.sleep_ms" keys. */
static nvmlReturn_t begin(cfg_t *c, int gpu, const char *fn) {
    char key[96];
    count_call(fn);
    cfg_load(c);
    snprintf(key, sizeof key, "%s.sleep_ms", fn);
    sleep_ms(cfg_int(c, gpu, key, 0));
    if (gpu >= 0) sleep_ms(cfg_int(c, gpu, "sleep_ms", 0));
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (gpu >= 0 && cfg_int(c, gpu, "lost", 0)) return NVML_ERROR_GPU_IS_LOST;
    snprintf(key, sizeof key, "%s.error", fn);
    return (nvmlReturn_t)cfg_int(c, gpu, key, NVML_SUCCESS);
}

static int gpu_of(nvmlDevice_t dev) {
    long i = dev ? (long)(dev - devices) : -1;
    return (i >= 0 && i < MAX_GPUS) ? (int)i : -1;
}

/* Device-call prologue: declares `c` and `g`, validates the handle, returns early on error. */
#define DEVICE_CALL(fn)                                        \
    cfg_t c;                                                   \
    int g = gpu_of(dev);                                       \
    if (g < 0) return NVML_ERROR_INVALID_ARGUMENT;             \
    { nvmlReturn_t rc_ = begin(&c, g, fn); if (rc_) return rc_; }

static nvmlReturn_t copy_str(char *buf, unsigned int len, const char *s) {
    if (!buf || strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ library / system */

/* Not NVML: lets a test prove pynvml loaded this library, and count initialisations. */
int fake_nvml_init_calls(void) { return init_calls; }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    cfg_t c;
    (void)flags;
    count_call("init");
    cfg_load(&c);
    sleep_ms(cfg_int(&c, -1, "init.sleep_ms", 0));
    nvmlReturn_t rc = (nvmlReturn_t)cfg_int(&c, -1, "init_error", NVML_SUCCESS);
    if (rc == NVML_SUCCESS) {
        init_refcount++;
        init_calls++;
    }
    return rc;
}

nvmlReturn_t nvmlShutdown(void) {
    count_call("shutdown");
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    init_refcount--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch ((int)result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t system_str(const char *fn, const char *dflt, char *buf, unsigned int len) {
    cfg_t c;
    char val[96];
    nvmlReturn_t rc = begin(&c, -1, fn);
    if (rc) return rc;
    return copy_str(buf, len, cfg_get(&c, fn, val, sizeof val) ? val : dflt);
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return system_str("driver_version", "550.54.15", version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return system_str("nvml_version", "12.550.54.15", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    cfg_t c;
    nvmlReturn_t rc = begin(&c, -1, "count");
    if (rc) return rc;
    long long n = cfg_int(&c, -1, "count", 0);
    *deviceCount = (unsigned int)(n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : n);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    cfg_t c;
    cfg_load(&c);
    if (index >= MAX_GPUS || (long long)index >= cfg_int(&c, -1, "count", 0)) {
        return init_refcount ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    }
    nvmlReturn_t rc = begin(&c, (int)index, "handle");
    if (rc) return rc;
    *device = &devices[index];
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ identity */

static nvmlReturn_t device_str(nvmlDevice_t dev, const char *fn, char *buf, unsigned int len) {
    DEVICE_CALL(fn);
    char dflt[64], val[128];
    snprintf(dflt, sizeof dflt, "%s-%d", fn, g);
    return copy_str(buf, len, cfg_str(&c, g, fn, val, sizeof val, dflt));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    return device_str(dev, "name", name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    return device_str(dev, "uuid", uuid, length);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t dev, char *serial, unsigned int length) {
    return device_str(dev, "serial", serial, length);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    DEVICE_CALL("pci_info");
    char bus_id[64], dflt[32];
    unsigned int domain = 0, bus = 0, device = 0, function = 0;
    snprintf(dflt, sizeof dflt, "00000000:%02X:00.0", 0x10 + g);
    cfg_str(&c, g, "bus_id", bus_id, sizeof bus_id, dflt);
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4) return NVML_ERROR_UNKNOWN;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, device, function);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus,
             device, function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = device;
    pci->pciDeviceId = (unsigned int)cfg_int(&c, g, "pci_device_id", 0x233010DE); /* H100 SXM5 */
    pci->pciSubSystemId = (unsigned int)cfg_int(&c, g, "pci_subsystem_id", 0x16C110DE);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ scalar reads */

/* A read of one configured integer: `fn` names the function (error/sleep keys), `key` the value.
 * A value key that is absent means the GPU does not support the read (NotSupported). */
static nvmlReturn_t device_int(nvmlDevice_t dev, const char *fn, const char *key,
                               long long *out) {
    DEVICE_CALL(fn);
    long long v = cfg_int(&c, g, key, -1);
    if (v < 0) return NVML_ERROR_NOT_SUPPORTED;
    *out = v;
    return NVML_SUCCESS;
}

#define UINT_READ(symbol, fn, key)                                    \
    nvmlReturn_t symbol(nvmlDevice_t dev, unsigned int *value) {      \
        long long v;                                                  \
        nvmlReturn_t rc = device_int(dev, fn, key, &v);               \
        if (rc == NVML_SUCCESS) *value = (unsigned int)v;                       \
        return rc;                                                    \
    }

UINT_READ(nvmlDeviceGetPcieReplayCounter, "pcie_replay", "pcie_replay")
UINT_READ(nvmlDeviceGetCurrPcieLinkGeneration, "pcie_gen", "pcie_gen")
UINT_READ(nvmlDeviceGetMaxPcieLinkGeneration, "pcie_gen_max", "pcie_gen_max")
UINT_READ(nvmlDeviceGetCurrPcieLinkWidth, "pcie_width", "pcie_width")
UINT_READ(nvmlDeviceGetMaxPcieLinkWidth, "pcie_width_max", "pcie_width_max")

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, nvmlTemperatureSensors_t sensor,
                                      unsigned int *temp) {
    long long v;
    if ((int)sensor != 0) return NVML_ERROR_INVALID_ARGUMENT; /* only NVML_TEMPERATURE_GPU exists */
    nvmlReturn_t rc = device_int(dev, "temperature", "temperature", &v);
    if (rc == NVML_SUCCESS) *temp = (unsigned int)v;
    return rc;
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t dev,
                                               nvmlTemperatureThresholds_t thresholdType,
                                               unsigned int *temp) {
    static const char *keys[] = {"threshold.shutdown", "threshold.slowdown"};
    long long v;
    if ((int)thresholdType < 0 || (int)thresholdType > 1) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = device_int(dev, "threshold", keys[(int)thresholdType], &v);
    if (rc == NVML_SUCCESS) *temp = (unsigned int)v;
    return rc;
}

nvmlReturn_t nvmlDeviceGetMarginTemperature(nvmlDevice_t dev, nvmlMarginTemperature_t *info) {
    DEVICE_CALL("margin");
    if (info->version != nvmlMarginTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    char val[32];
    if (!cfg_str(&c, g, "margin", val, sizeof val, "")[0]) return NVML_ERROR_NOT_SUPPORTED;
    info->marginTemperature = (int)strtol(val, NULL, 0); /* may be negative: past the threshold */
    return NVML_SUCCESS;
}

static nvmlReturn_t clock_reasons(nvmlDevice_t dev, const char *fn, unsigned long long *out) {
    long long v;
    nvmlReturn_t rc = device_int(dev, fn, "clock_reasons", &v);
    if (rc == NVML_SUCCESS) *out = (unsigned long long)v;
    return rc;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *r) {
    return clock_reasons(dev, "clocks_event_reasons", r);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *r) {
    return clock_reasons(dev, "clocks_throttle_reasons", r);
}

/* ------------------------------------------------------------------ memory errors */

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts) {
    static const char *keys[2][2] = {{"ecc.corrected.volatile", "ecc.corrected.aggregate"},
                                     {"ecc.uncorrected.volatile", "ecc.uncorrected.aggregate"}};
    long long v;
    if ((unsigned)errorType > 1 || (unsigned)counterType > 1) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_int(dev, "ecc", keys[errorType][counterType], &v);
    if (rc == NVML_SUCCESS) *eccCounts = (unsigned long long)v;
    return rc;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred) {
    DEVICE_CALL("remapped_rows");
    if (cfg_int(&c, g, "remapped_rows.corrected", -1) < 0) return NVML_ERROR_NOT_SUPPORTED; /* pre-Ampere */
    *corrRows = (unsigned int)cfg_int(&c, g, "remapped_rows.corrected", 0);
    *uncRows = (unsigned int)cfg_int(&c, g, "remapped_rows.uncorrected", 0);
    *isPending = (unsigned int)cfg_int(&c, g, "remapped_rows.pending", 0);
    *failureOccurred = (unsigned int)cfg_int(&c, g, "remapped_rows.failure", 0);
    return NVML_SUCCESS;
}

/* Two-call protocol: with *pageCount too small (pynvml first passes 0 and NULL) report the count
 * and return INSUFFICIENT_SIZE (SUCCESS when there are none); then fill the caller's buffer. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t dev, nvmlPageRetirementCause_t cause,
                                       unsigned int *pageCount, unsigned long long *addresses) {
    DEVICE_CALL("retired_pages");
    if ((unsigned)cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    long long n = cfg_int(&c, g, cause ? "retired_pages.dbe" : "retired_pages.sbe", -1);
    if (n < 0) return NVML_ERROR_NOT_SUPPORTED; /* Ampere and later retire rows, not pages */
    if (*pageCount < (unsigned int)n || (n > 0 && !addresses)) {
        *pageCount = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (long long i = 0; i < n; i++)
        addresses[i] = 0x100000000ULL * (unsigned)(cause + 1) + 0x1000ULL * (unsigned long long)i;
    *pageCount = (unsigned int)n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t dev, nvmlEnableState_t *isPending) {
    long long v;
    nvmlReturn_t rc = device_int(dev, "retired_pages_pending", "retired_pages_pending", &v);
    if (rc == NVML_SUCCESS) *isPending = v ? 1 : 0;
    return rc;
}

/* ------------------------------------------------------------------ NVLink */

/* gpuN.nvlink.links=18 (absent or 0: no NVLink, NotSupported), gpuN.nvlink.down=3,7 (inactive
 * links), gpuN.nvlink<L>.<replay|recovery|crc_flit|crc_data>=V (default 0). Links past the last
 * one answer INVALID_ARGUMENT, as the real library does. */
static nvmlReturn_t nvlink_check(cfg_t *c, int g, unsigned int link) {
    long long links = cfg_int(c, g, "nvlink.links", 0);
    if (links <= 0) return NVML_ERROR_NOT_SUPPORTED;
    return link < (unsigned long long)links ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

static nvmlReturn_t nvlink_state(cfg_t *c, int g, unsigned int link, int *active) {
    nvmlReturn_t rc = nvlink_check(c, g, link);
    if (rc) return rc;
    char down[256], *tok, *save = NULL;
    *active = 1;
    cfg_str(c, g, "nvlink.down", down, sizeof down, "");
    for (tok = strtok_r(down, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (strtol(tok, NULL, 10) == (long)link) *active = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link,
                                      nvmlEnableState_t *isActive) {
    DEVICE_CALL("nvlink_state");
    int active;
    nvmlReturn_t rc = nvlink_state(&c, g, link, &active);
    if (rc == NVML_SUCCESS) *isActive = active;
    return rc;
}

/* A function left out of the build (-D<symbol>=omitted_<symbol>) takes its fields with it. */
#ifdef nvmlDeviceGetTotalEccErrors
#define OMIT_ECC 1
#else
#define OMIT_ECC 0
#endif
#ifdef nvmlDeviceGetPcieReplayCounter
#define OMIT_REPLAY 1
#else
#define OMIT_REPLAY 0
#endif
#ifdef nvmlDeviceGetRemappedRows
#define OMIT_REMAP 1
#else
#define OMIT_REMAP 0
#endif
#ifdef nvmlDeviceGetRetiredPages
#define OMIT_RETIRED 1
#else
#define OMIT_RETIRED 0
#endif
#ifdef nvmlDeviceGetRetiredPagesPendingStatus
#define OMIT_PENDING 1
#else
#define OMIT_PENDING 0
#endif

/* Counter fields (ids from nvml.h): the value key and the <fn> whose .error / .sleep_ms keys
 * apply, as for the function that reads the same value one call at a time. */
static const struct { unsigned int id; const char *fn, *key; int omitted; } COUNTER_FIELDS[] = {
    {3, "ecc", "ecc.corrected.volatile", OMIT_ECC},     /* NVML_FI_DEV_ECC_SBE_VOL_TOTAL */
    {4, "ecc", "ecc.uncorrected.volatile", OMIT_ECC},   /* NVML_FI_DEV_ECC_DBE_VOL_TOTAL */
    {5, "ecc", "ecc.corrected.aggregate", OMIT_ECC},    /* NVML_FI_DEV_ECC_SBE_AGG_TOTAL */
    {6, "ecc", "ecc.uncorrected.aggregate", OMIT_ECC},  /* NVML_FI_DEV_ECC_DBE_AGG_TOTAL */
    {29, "retired_pages", "retired_pages.sbe", OMIT_RETIRED},               /* RETIRED_SBE */
    {30, "retired_pages", "retired_pages.dbe", OMIT_RETIRED},               /* RETIRED_DBE */
    {31, "retired_pages_pending", "retired_pages_pending", OMIT_PENDING},   /* RETIRED_PENDING */
    {94, "pcie_replay", "pcie_replay", OMIT_REPLAY},                        /* PCIE_REPLAY_COUNTER */
    {142, "remapped_rows", "remapped_rows.corrected", OMIT_REMAP},          /* REMAPPED_COR */
    {143, "remapped_rows", "remapped_rows.uncorrected", OMIT_REMAP},        /* REMAPPED_UNC */
    {144, "remapped_rows", "remapped_rows.pending", OMIT_REMAP},            /* REMAPPED_PENDING */
    {145, "remapped_rows", "remapped_rows.failure", OMIT_REMAP},            /* REMAPPED_FAILURE */
};
#define N_COUNTER_FIELDS (sizeof COUNTER_FIELDS / sizeof COUNTER_FIELDS[0])

static nvmlReturn_t counter_field(cfg_t *c, int g, unsigned int id, unsigned long long *out, int *slept) {
    char key[96];
    for (size_t k = 0; k < N_COUNTER_FIELDS; k++) {
        if (COUNTER_FIELDS[k].id != id) continue;
        if (COUNTER_FIELDS[k].omitted) return NVML_ERROR_NOT_SUPPORTED;
        if (!slept[k]) { /* a function's sleep once per call, however many of its fields */
            snprintf(key, sizeof key, "%s.sleep_ms", COUNTER_FIELDS[k].fn);
            for (size_t j = 0; j < N_COUNTER_FIELDS; j++)
                if (strcmp(COUNTER_FIELDS[j].fn, COUNTER_FIELDS[k].fn) == 0) slept[j] = 1;
            sleep_ms(cfg_int(c, g, key, 0));
        }
        snprintf(key, sizeof key, "%s.error", COUNTER_FIELDS[k].fn);
        nvmlReturn_t rc = (nvmlReturn_t)cfg_int(c, g, key, NVML_SUCCESS);
        if (rc) return rc;
        /* pre-Ampere: no row remapping at all, as nvmlDeviceGetRemappedRows answers */
        const char *gate = id >= 142 ? "remapped_rows.corrected" : COUNTER_FIELDS[k].key;
        if (cfg_int(c, g, gate, -1) < 0) return NVML_ERROR_NOT_SUPPORTED;
        *out = (unsigned long long)cfg_int(c, g, COUNTER_FIELDS[k].key, 0);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

/* Field values, one call for many: NVML_FI_DEV_NVLINK_GET_STATE (scopeId = link) answers
 * NVML_NVLINK_STATE_ACTIVE (1) or _INACTIVE (0) as nvmlDeviceGetNvLinkState would, with its
 * `nvlink_state.error` as the entry's nvmlReturn; the COUNTER_FIELDS answer from the same keys as
 * their functions; any other field is NotSupported. The call's own `field_values.error` /
 * `.sleep_ms` / `lost` fail the whole call. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int valuesCount, nvmlFieldValue_t *values) {
    DEVICE_CALL("field_values");
    if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t state_error = (nvmlReturn_t)cfg_int(&c, g, "nvlink_state.error", NVML_SUCCESS);
    int slept[N_COUNTER_FIELDS] = {0};
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        int active = 0;
        v->timestamp = (long long)time(NULL) * 1000000LL;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == NVML_FI_DEV_NVLINK_GET_STATE) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->nvmlReturn = state_error ? state_error : nvlink_state(&c, g, v->scopeId, &active);
            if (v->nvmlReturn == NVML_SUCCESS) v->value.uiVal = (unsigned int)active;
        } else {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->nvmlReturn = counter_field(&c, g, v->fieldId, &v->value.ullVal, slept);
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t dev, unsigned int link,
                                             nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue) {
    static const char *names[] = {"replay", "recovery", "crc_flit", "crc_data"};
    DEVICE_CALL("nvlink_error_counter");
    nvmlReturn_t rc = nvlink_check(&c, g, link);
    if (rc) return rc;
    if ((unsigned)counter > 3) return NVML_ERROR_NOT_SUPPORTED;
    char key[64];
    snprintf(key, sizeof key, "nvlink%u.%s", link, names[counter]);
    *counterValue = (unsigned long long)cfg_int(&c, g, key, 0);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ processes */

/* gpuN.processes=PID[:BYTES],PID... : the processes with a compute context on GPU N (absent: none).
 * As the real library: with *infoCount too small (pynvml's first call passes 0 and NULL), the count
 * needed and INSUFFICIENT_SIZE; otherwise the entries and their count. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    DEVICE_CALL("processes");
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    char list[1024], *tok, *save = NULL;
    unsigned int n = 0, room = *infoCount;
    cfg_str(&c, g, "processes", list, sizeof list, "");
    for (tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(tok, ':');
        if (infos && n < room) {
            infos[n].pid = (unsigned int)strtoul(tok, NULL, 10);
            infos[n].usedGpuMemory = colon ? strtoull(colon + 1, NULL, 10) : 0;
            infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFFu;
        }
        n++;
    }
    *infoCount = n;
    return (n > room || (n && !infos)) ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

/* The same list through the older symbol (the same 24-byte entries as v3), which drivers that lack
 * _v3 export: the collector falls back to it. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(dev, infoCount, infos);
}
