"""NVML collector: per-GPU identity, temperatures, clock events and the leading hardware indicators
(ECC, row remapping, retired pages, PCIe replays and link state, NVLink errors), read through
nvidia-ml-py's `pynvml` exactly as the driver exposes them.

Rules this module keeps:
- No driver library on the node is "no data", not an error: a CPU node is not sick.
- A read the GPU or driver cannot answer (NotSupported, or a symbol this driver lacks) is a None
  field named in `GpuSample.no_data`; any other NVML error for a read goes to `GpuSample.errors`.
  Neither stops the other reads.
- A symbol the driver lacks (an NVML older than the function) is no fault of the node: the readings
  it leaves without data are listed in `NvmlSample.driver_lacks` (function -> readings, the same on
  every tick until NVML is initialised again) and logged once. Only the functions nothing can be
  read without (REQUIRED_FUNCTIONS) make the whole collection an error, `driver_too_old`.
- GPU_IS_LOST, wherever NVML answers it (handle lookup included), makes a `lost` GpuSample.
- NVML calls can hang inside the driver (a GPU falling off the bus, a wedged RM). Every collection
  runs in a worker thread and the caller waits at most `timeout_s`; while a worker is still stuck,
  no second one is started, so at most one thread is ever blocked in the driver.
- ECC totals, PCIe replays, retired-page counts and pending, and remapped rows come in one
  nvmlDeviceGetFieldValues call per GPU (11 calls before); a field it does not answer is read by
  its own function, exactly as before.
- Identity and fixed limits (STATIC_FIELDS: name, UUID, serial, bus id, slowdown threshold, max
  PCIe gen/width) are read once per GPU per initialisation; a read that failed is tried again.
- NVLink: the state of every link comes in one nvmlDeviceGetFieldValues call per GPU (falling back
  to one nvmlDeviceGetNvLinkState per link where the driver has no such field); the four error
  counters of each active link (72 calls on an H100) are read every `nvlink_counter_interval_s`
  and carried in no other tick, so their deltas span the interval. An increase is found as before,
  at most that much later.
- The ever-growing counters (volatile ECC, PCIe replays, NVLink errors) also arrive as deltas
  against this collector's baseline per GPU (healthd.agent.collectors.counters), taken on the
  caller's side once a collection returns: a collection that timed out moves no baseline, so the
  next good one's delta spans the gap.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import pynvml

from healthd.agent.collectors.counters import Baseline, Reading, counter_delta
from healthd.model import GpuSample, NvmlSample, normalize_bus_id
from healthd.persist import read_boot_id

log = logging.getLogger(__name__)

LIBRARY_NAME = "libnvidia-ml.so.1"
LIBRARY_MISSING_DETAIL = f"{LIBRARY_NAME} not found: no NVIDIA driver on this node"

# Answers meaning "this GPU/driver cannot give this value": the field is no data, not a failure.
# FunctionNotFound is what pynvml raises when the loaded driver lacks the symbol (older driver).
_NO_DATA_ERRORS = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)

REQUIRED_FUNCTIONS = ("nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2")
"""The symbols pynvml's nvmlInit, nvmlDeviceGetCount and nvmlDeviceGetHandleByIndex call: without
one nothing at all can be read, so a driver that lacks one is a collection error, never a quiet node
with no GPU readings."""
TOO_OLD = "driver_too_old"

# Single-value reads: GpuSample field -> (pynvml function, extra arguments after the handle).
_SCALAR_READS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("temperature_c", "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,)),
    ("margin_c", "nvmlDeviceGetMarginTemperature", ()),
    (
        "slowdown_threshold_c",
        "nvmlDeviceGetTemperatureThreshold",
        (pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,),
    ),
    # ecc_{corrected,uncorrected}_{volatile,aggregate}: one NVML call over the error type and the counter's lifetime
    *(
        (f"ecc_{error}_{counter}", "nvmlDeviceGetTotalEccErrors", (error_type, counter_type))
        for counter, counter_type in (("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC))
        for error, error_type in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                  ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
    ),
    ("pcie_replay", "nvmlDeviceGetPcieReplayCounter", ()),
    ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", ()),
    ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", ()),
    ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", ()),
    ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", ()),
)

_REMAP_FIELDS = ("remap_corrected", "remap_uncorrected", "remap_pending", "remap_failure")
_IDENTITY_FIELDS = ("name", "uuid", "serial", "bus_id")
# What a GPU cannot change while NVML stays initialised (another board, or another limit, takes a
# driver reload, and that fails the calls and makes the next collect initialise afresh): read once
# per GPU per initialisation, 7 calls a GPU saved on every later tick.
STATIC_FIELDS = (*_IDENTITY_FIELDS, "slowdown_threshold_c", "pcie_gen_max", "pcie_width_max")

# NVLink data-link error counters read for each active link (key suffix -> NVML counter id).
_NVLINK_COUNTERS = (
    ("replay", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
    ("crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
)


# GpuSample fields whose value only grows until a reset, reboot or driver reload.
COUNTER_FIELDS = ("ecc_uncorrected_volatile", "ecc_corrected_volatile", "pcie_replay")
NVLINK_PREFIX = "nvlink/"

BASELINE_MAX_AGE_S = 7 * 86400.0
"""The baseline of a GPU not read for this long (removed, or its identity changed) is forgotten."""


def counter_readings(g: GpuSample) -> Iterator[tuple[str, int]]:
    """(name in GpuSample.counters, raw value) for each counter this GPU reported."""
    for name in COUNTER_FIELDS:
        value = getattr(g, name)
        if value is not None:
            yield name, value
    for link, value in sorted(g.nvlink_errors.items()):
        yield NVLINK_PREFIX + link, value


def gpu_identity(g: GpuSample) -> str:
    """The key of a GPU's baseline: its UUID, else its bus id, else its index."""
    # a driver without the UUID and PCI functions leaves both unread: the index is all there is
    return g.uuid or (normalize_bus_id(g.bus_id) if g.bus_id else None) or f"index{g.index}"


def with_deltas(sample: NvmlSample, baseline: Baseline, boot_id: str | None, now: float) -> tuple[NvmlSample, Baseline]:
    """The sample, stamped with its read time and each GPU's counter deltas, and the new baseline.
    A lost GPU, a counter it did not report, and a GPU not read this time keep their baseline."""
    baseline = baseline.on_boot(boot_id, "nvml")
    sample = dataclasses.replace(sample, time=now)
    if sample.status != "ok":
        return sample, baseline
    groups: dict[str, Mapping[str, Reading]] = {
        ident: counters for ident, counters in baseline.groups.items()
        if counters and max(t for _, t in counters.values()) > now - BASELINE_MAX_AGE_S
    }
    gpus = []
    for g in sample.gpus:
        if g.lost:
            gpus.append(g)
            continue
        ident = gpu_identity(g)
        previous = baseline.groups.get(ident, {})
        last = dict(previous)
        deltas = {}
        for name, value in counter_readings(g):
            deltas[name] = counter_delta(value, previous.get(name), now)
            last[name] = (value, now)
        groups[ident] = last
        gpus.append(g.with_counters(deltas))
    return dataclasses.replace(sample, gpus=tuple(gpus)), Baseline(boot_id=baseline.boot_id, groups=groups)


def nvml_available() -> bool:
    """True when the NVIDIA driver's NVML library can be loaded in this process."""
    try:
        ctypes.CDLL(LIBRARY_NAME)
    except OSError:
        return False
    return True


class _Job:
    """One collection running in a worker thread. `call` names the NVML call in flight, so a
    timeout can say where the driver hung."""

    def __init__(self) -> None:
        self.call = "nvmlInit"
        self.started = time.monotonic()
        self.result: NvmlSample | None = None
        self.done = threading.Event()


class _FieldValue(ctypes.Structure):
    """pynvml's c_nvmlFieldValue_t without its formatting hooks on every attribute access, which
    cost more than the call itself (pynvml's own nvmlDeviceGetFieldValues pays them 4 times an
    entry). Same layout: the same fields, taken from it."""

    _fields_ = list(pynvml.c_nvmlFieldValue_t._fields_)


class _FieldRequest:
    """A fixed list of (field id, scope id): the array is built once and copied per call."""

    def __init__(self, fields: tuple[tuple[int, int], ...]) -> None:
        self.count = len(fields)
        self._type = _FieldValue * self.count
        template = self._type()
        for entry, (field_id, scope_id) in zip(template, fields, strict=True):
            entry.fieldId, entry.scopeId = field_id, scope_id
        self._template = bytes(template)

    def fresh(self) -> Any:
        return self._type.from_buffer_copy(self._template)


class _GpuReads:
    """The reads of one GPU in one tick: values so far, fields with no data, and read errors."""

    def __init__(self, job: _Job, index: int, handle: Any, static: Mapping[str, Any] | None = None) -> None:
        self.job = job
        self.index = index
        self.handle = handle
        self.static = dict(static or {})
        self.batch: dict[int, int] = {}
        """Field id -> value of the counter fields this tick's field-value call answered."""
        """STATIC_FIELDS values read by an earlier tick of this initialisation: not read again."""
        self.current = ""
        """The NVML function called last: where a GPU_IS_LOST came from."""
        self.values: dict[str, Any] = {}
        self.no_data: list[str] = []
        self.errors: dict[str, str] = {}
        self.lacks: dict[str, str] = {}
        """Reading (a `no_data` name) -> the NVML function this driver lacks for it."""

    def raw(self, fn_name: str, *args: Any) -> Any:
        """One NVML call on this GPU; raises NVMLError as pynvml does."""
        fn = getattr(pynvml, fn_name, None)
        if fn is None:  # an older nvidia-ml-py without this wrapper: same as a missing symbol
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        self.current = fn_name
        self.job.call = f"{fn_name} on GPU {self.index}"
        return fn(self.handle, *args)

    def field_values(self, request: "_FieldRequest") -> Any:
        """One nvmlDeviceGetFieldValues call for `request`; raises NVMLError as pynvml does."""
        self.current = "nvmlDeviceGetFieldValues"
        self.job.call = f"nvmlDeviceGetFieldValues on GPU {self.index}"
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")  # FunctionNotFound on old drivers
        values = request.fresh()
        pynvml._nvmlCheckReturn(fn(self.handle, ctypes.c_int32(request.count), ctypes.byref(values)))
        return values

    def read(
        self,
        fields: str | tuple[str, ...],
        fn_name: str,
        *args: Any,
        fallback: str | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Call `fn_name` (or `fallback` when the driver lacks it) for `fields` and return the value
        passed through `convert`, or None after recording the fields as no data or as errors.
        GPU_IS_LOST propagates: the caller turns the whole GPU into a lost sample."""
        names = (fields,) if isinstance(fields, str) else fields
        try:
            try:
                value = self.raw(fn_name, *args)
            except pynvml.NVMLError_FunctionNotFound:
                if fallback is None:
                    raise
                fn_name = fallback
                value = self.raw(fn_name, *args)
            return value if convert is None else convert(value)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError_FunctionNotFound:
            self.no_data.extend(names)
            self.lacks.update(dict.fromkeys(names, fn_name))
        except _NO_DATA_ERRORS:
            self.no_data.extend(names)
        except pynvml.NVMLError as e:
            self.errors.update({n: f"{fn_name}: {e}" for n in names})
        except Exception as e:  # a malformed answer (bytes that are not text) costs one field
            self.errors.update({n: f"{fn_name}: {type(e).__name__}: {e}" for n in names})
        return None


# --------------------------------------------------------------------------- one read each


# Counter values NVML also serves as fields (ids from nvml.h): GpuSample field -> field id.
_FIELD_IDS = {
    "ecc_corrected_volatile": pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
    "ecc_uncorrected_volatile": pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
    "ecc_corrected_aggregate": pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
    "ecc_uncorrected_aggregate": pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
    "pcie_replay": pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
    "retired_pages_sbe": pynvml.NVML_FI_DEV_RETIRED_SBE,
    "retired_pages_dbe": pynvml.NVML_FI_DEV_RETIRED_DBE,
    "retired_pending": pynvml.NVML_FI_DEV_RETIRED_PENDING,
    "remap_corrected": pynvml.NVML_FI_DEV_REMAPPED_COR,
    "remap_uncorrected": pynvml.NVML_FI_DEV_REMAPPED_UNC,
    "remap_pending": pynvml.NVML_FI_DEV_REMAPPED_PENDING,
    "remap_failure": pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
}
_COUNTER_FIELDS = _FieldRequest(tuple((field_id, 0) for field_id in _FIELD_IDS.values()))
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def _read_counter_fields(r: _GpuReads) -> None:
    """The counters above in one call. Only answers that succeeded are kept: every other field
    (NotSupported, an error, a driver without the call) is read by its own function as before, so
    no data, errors and GPU_IS_LOST say exactly what they always said."""
    try:
        values = r.field_values(_COUNTER_FIELDS)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return
    for v in values:
        member = _VALUE_MEMBER.get(v.valueType)
        if v.nvmlReturn == pynvml.NVML_SUCCESS and member is not None:
            r.batch[v.fieldId] = int(getattr(v.value, member))


def _batched(r: _GpuReads, *fields: str) -> list[int] | None:
    """The values of `fields` from the field-value call, or None unless it answered all of them."""
    ids = [_FIELD_IDS[f] for f in fields]
    return [r.batch[i] for i in ids] if all(i in r.batch for i in ids) else None


def _read_identity(r: _GpuReads) -> None:
    for field, fn_name in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID"), ("serial", "nvmlDeviceGetSerial")):
        r.values[field] = r.static[field] if field in r.static else r.read(field, fn_name)
    if "bus_id" in r.static:
        r.values["bus_id"] = r.static["bus_id"]
        return
    raw = r.read("bus_id", "nvmlDeviceGetPciInfo_v3", convert=lambda pci: pci.busId)
    if raw is not None:
        # The one key GPUs are joined on across sources (kernel log, sysfs): normalise it here.
        r.values["bus_id"] = normalize_bus_id(raw)
        if r.values["bus_id"] is None:
            r.errors["bus_id"] = f"nvmlDeviceGetPciInfo_v3: unparseable busId {raw!r}"


def _read_scalars(r: _GpuReads) -> None:
    for field, fn_name, args in _SCALAR_READS:
        if field in r.static:
            r.values[field] = r.static[field]
        elif field in _FIELD_IDS and _FIELD_IDS[field] in r.batch:
            r.values[field] = r.batch[_FIELD_IDS[field]]
        else:
            r.values[field] = r.read(field, fn_name, *args)


def _read_clock_event_reasons(r: _GpuReads) -> None:
    # Drivers before R535 export only the old name ("throttle reasons"); the bits are the same.
    r.values["clock_event_reasons"] = r.read(
        "clock_event_reasons",
        "nvmlDeviceGetCurrentClocksEventReasons",
        fallback="nvmlDeviceGetCurrentClocksThrottleReasons",
    )


def _read_remapped_rows(r: _GpuReads) -> None:
    # Ampere and later; NotSupported on older GPUs and while MIG instances are active.
    rows = _batched(r, *_REMAP_FIELDS) or r.read(_REMAP_FIELDS, "nvmlDeviceGetRemappedRows")
    if rows is not None:
        corrected, uncorrected, pending, failure = rows
        r.values.update(
            remap_corrected=int(corrected),
            remap_uncorrected=int(uncorrected),
            remap_pending=bool(pending),
            remap_failure=bool(failure),
        )


def _read_retired_pages(r: _GpuReads) -> None:
    # Dynamic page retirement is the pre-Ampere mechanism; newer GPUs answer NotSupported. The
    # fields count the pages; the functions list them.
    for field, cause in (("retired_pages_sbe", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                         ("retired_pages_dbe", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)):
        count = _batched(r, field)
        if count is None:
            pages = r.read(field, "nvmlDeviceGetRetiredPages", cause)
            r.values[field] = None if pages is None else len(pages)
        else:
            r.values[field] = count[0]
    pending = _batched(r, "retired_pending")
    if pending is None:
        pending = r.read("retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
    else:
        pending = pending[0]
    r.values["retired_pending"] = None if pending is None else bool(pending)


_NVLINK_STATE_FIELDS = _FieldRequest(tuple((pynvml.NVML_FI_DEV_NVLINK_GET_STATE, link)
                                           for link in range(pynvml.NVML_NVLINK_MAX_LINKS)))


def _link_states_batched(r: _GpuReads) -> Iterator[tuple[int, Exception | int]] | None:
    """(link, state or the NVMLError its entry answered) from one field-value call; None when the
    driver cannot answer the call at all (the per-link reads follow)."""
    try:
        values = r.field_values(_NVLINK_STATE_FIELDS)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None
    return ((v.scopeId, pynvml.NVMLError(v.nvmlReturn) if v.nvmlReturn else int(v.value.uiVal)) for v in values)


def _link_states_one_by_one(r: _GpuReads) -> Iterator[tuple[int, Exception | int]]:
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            yield link, int(r.raw("nvmlDeviceGetNvLinkState", link))
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as e:
            yield link, e


def _read_nvlink_errors(r: _GpuReads, counters_due: bool = True) -> dict[str, int]:
    """`link<N>.<counter>` -> value for every link NVML reports active (empty when the counters are
    not due this tick: the states are read regardless). A GPU without NVLink answers NotSupported
    for every link; links past the last one answer InvalidArgument."""
    counters: dict[str, int] = {}
    any_link = False
    unsupported: set[str] = set()
    states = _link_states_batched(r)
    source = "nvmlDeviceGetFieldValues(NVLINK_GET_STATE)"
    if states is None:
        states, source = _link_states_one_by_one(r), "nvmlDeviceGetNvLinkState"
    for link, state in states:
        if isinstance(state, pynvml.NVMLError_FunctionNotFound):
            r.lacks["nvlink_errors"] = source  # neither the field nor the per-link function
            break
        if isinstance(state, pynvml.NVMLError_InvalidArgument):
            break
        if isinstance(state, pynvml.NVMLError_NotSupported):
            continue
        if isinstance(state, pynvml.NVMLError_GpuIsLost):
            r.current = source
            raise state
        if isinstance(state, Exception):
            r.errors[f"nvlink_errors.link{link}"] = f"{source}: {state}"
            continue
        any_link = True
        if state == pynvml.NVML_NVLINK_STATE_INACTIVE or not counters_due:
            continue
        for name, counter in _NVLINK_COUNTERS:
            try:
                counters[f"link{link}.{name}"] = int(
                    r.raw("nvmlDeviceGetNvLinkErrorCounter", link, counter)
                )
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError_FunctionNotFound:
                unsupported.add(name)
                r.lacks[f"nvlink_errors.{name}"] = "nvmlDeviceGetNvLinkErrorCounter"
            except _NO_DATA_ERRORS:
                unsupported.add(name)
            except pynvml.NVMLError as e:
                r.errors[f"nvlink_errors.link{link}.{name}"] = f"nvmlDeviceGetNvLinkErrorCounter: {e}"
    if not any_link:
        r.no_data.append("nvlink_errors")
    # One entry per counter kind, not per link: a driver that dropped a counter drops it on all 18.
    r.no_data.extend(f"nvlink_errors.{name}" for name, _ in _NVLINK_COUNTERS if name in unsupported)
    return counters


def _read_processes(r: _GpuReads) -> None:
    # The join of a training rank (its ring names its PID) to the GPU it really runs on.
    # pynvml's nvmlDeviceGetComputeRunningProcesses calls the _v3 symbol only; a driver without it
    # has _v2, whose entries have the same layout.
    r.values["compute_pids"] = r.read("compute_pids", "nvmlDeviceGetComputeRunningProcesses_v3",
                                      fallback="nvmlDeviceGetComputeRunningProcesses_v2",
                                      convert=lambda procs: tuple(int(p.pid) for p in procs))


_GPU_READS: tuple[Callable[[_GpuReads], None], ...] = (
    _read_identity,
    _read_counter_fields,
    _read_scalars,
    _read_clock_event_reasons,
    _read_remapped_rows,
    _read_retired_pages,
    _read_processes,
)


def _lost_gpu(index: int, where: str, error: Exception, identity: dict[str, Any]) -> GpuSample:
    return GpuSample(
        index=index,
        lost=True,
        lost_detail=f"{where}: {error} (NVML_ERROR_GPU_IS_LOST)",
        **{k: identity.get(k) for k in _IDENTITY_FIELDS},
    )


def _read_gpu(job: _Job, index: int, last_identity: dict[str, Any], nvlink_counters: bool = True,
              static: Mapping[str, Any] | None = None) -> tuple[GpuSample, Mapping[str, str]]:
    """Every read of one GPU, and reading -> the NVML function this driver lacks for it.
    `last_identity` is what an earlier tick read for this index: a GPU that is lost can no longer
    tell its serial, and the finding needs it. A driver without the handle lookup raises
    FunctionNotFound: no GPU can be read at all."""
    job.call = f"nvmlDeviceGetHandleByIndex({index})"
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError_GpuIsLost as e:
        return _lost_gpu(index, "nvmlDeviceGetHandleByIndex", e, last_identity), {}
    except pynvml.NVMLError_FunctionNotFound:
        raise
    except pynvml.NVMLError as e:
        return GpuSample(
            index=index,
            errors={"handle": f"nvmlDeviceGetHandleByIndex: {e}"},
            **{k: last_identity.get(k) for k in _IDENTITY_FIELDS},
        ), {}
    r = _GpuReads(job, index, handle, static)
    try:
        for read in _GPU_READS:
            read(r)
        nvlink = _read_nvlink_errors(r, nvlink_counters)
    except pynvml.NVMLError_GpuIsLost as e:
        # Prefer identity read this tick (before the GPU went), else the last known one.
        known = {k: r.values.get(k) or last_identity.get(k) for k in _IDENTITY_FIELDS}
        return _lost_gpu(index, r.current, e, known), r.lacks
    return GpuSample(
        index=index,
        **r.values,
        nvlink_errors=nvlink,
        no_data=tuple(r.no_data),
        errors=r.errors,
    ), r.lacks


def lacks_text(driver_lacks: Mapping[str, Any]) -> str:
    """`driver_lacks` in words: 'its NVML lacks nvmlDeviceGetRemappedRows (no remap_corrected, ...)'."""
    return "its NVML lacks " + "; ".join(f"{fn} (no {', '.join(readings)})" for fn, readings in driver_lacks.items())


def _too_old(call: str, e: Exception, symbol: str) -> NvmlSample:
    return NvmlSample(
        status="error",
        error_kind=TOO_OLD,
        detail=f"{call}: {e}: this {LIBRARY_NAME} lacks {symbol}, without which no GPU can be read "
        "(an NVIDIA driver older than the NVML healthd's nvidia-ml-py calls)",
    )


def _node_error_kind(e: pynvml.NVMLError) -> str:
    if isinstance(e, pynvml.NVMLError_DriverNotLoaded):
        return "driver_not_loaded"
    if isinstance(e, pynvml.NVMLError_LibraryNotFound):
        return "library_not_found"
    return "other"


# --------------------------------------------------------------------------- the collector


class NvmlCollector:
    """Reads all GPUs once per collect(). NVML is initialised on the first collect and kept; after
    a failed init (or a node-wide failure such as the device count) the next collect initialises
    again, so a driver that is loaded later, or recovers, is picked up without a restart."""

    name = "nvml"

    def __init__(
        self,
        timeout_s: float = 5.0,
        expected_gpus: int | None = None,
        boot_id_path: str = "/proc/sys/kernel/random/boot_id",
        baseline: Mapping | None = None,
        nvlink_counter_interval_s: float = 0.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._nvlink_interval_s = nvlink_counter_interval_s
        self._nvlink_read_at: float | None = None
        """The `now` of the last collection that read the NVLink error counters."""
        self._nvlink_due = True
        self._expected_gpus = expected_gpus
        self._boot_id_path = boot_id_path
        self._baseline = Baseline.from_json(baseline, "gpus", "nvml")
        self._initialized = False
        self._job: _Job | None = None
        self._identity: dict[int, dict[str, Any]] = {}
        self._static: dict[int, dict[str, Any]] = {}
        """GPU index -> STATIC_FIELDS read successfully since NVML was last initialised."""
        """GPU index -> identity fields from the last tick that could read them."""
        self._lacks: dict[str, set[str]] = {}
        """NVML function this driver lacks -> the readings left without data, since NVML was last
        initialised: kept, because some reads (the NVLink counters) are not made on every tick."""
        self._lacks_logged: set[tuple[str, str]] = set()
        """(function, reading) pairs already logged: said once per process, not once per tick."""

    # ---- public

    def collect(self, now: float) -> NvmlSample:
        last = self._nvlink_read_at
        self._nvlink_due = last is None or not now - self._nvlink_interval_s < last or now < last
        sample, self._baseline = with_deltas(self._read(), self._baseline, read_boot_id(self._boot_id_path), now)
        if sample.status == "ok" and self._nvlink_due:
            self._nvlink_read_at = now
        return sample

    def state(self) -> dict[str, Any]:
        """The counter baseline as JSON-serialisable data; pass it back as `baseline` after a restart."""
        return self._baseline.to_json("gpus")

    def _read(self) -> NvmlSample:
        stuck = self._job
        if stuck is not None and not stuck.done.is_set():
            age = time.monotonic() - stuck.started
            return NvmlSample(
                status="error",
                error_kind="timeout",
                detail=f"NVML call {stuck.call} still stuck after {age:.1f}s; "
                "no new collection started until it returns",
            )
        job = self._start(self._collect_all)
        if job.done.wait(self._timeout_s) and job.result is not None:
            return job.result
        log.warning("NVML call %s did not return within %.1fs", job.call, self._timeout_s)
        return NvmlSample(
            status="error",
            error_kind="timeout",
            detail=f"NVML call {job.call} did not return within {self._timeout_s:g}s",
        )

    def close(self) -> None:
        job = self._job
        if job is not None and not job.done.is_set():
            # Never call into NVML beside a thread blocked in the driver.
            log.warning("NVML call %s still stuck at close; not shutting NVML down", job.call)
            return
        if self._initialized:
            self._start(self._shutdown).done.wait(self._timeout_s)

    # ---- worker side (at most one worker thread at a time)

    def _start(self, body: Callable[[_Job], NvmlSample]) -> _Job:
        job = _Job()
        self._job = job

        def run() -> None:
            try:
                job.result = body(job)
            except Exception as e:  # collect() never raises: a bug here is reported as data
                log.exception("NVML collection failed")
                job.result = NvmlSample(
                    status="error",
                    error_kind="other",
                    detail=f"NVML collection failed: {type(e).__name__}: {e}",
                )
            finally:
                job.done.set()

        threading.Thread(target=run, name="healthd-nvml", daemon=True).start()
        return job

    def _init(self, job: _Job) -> NvmlSample | None:
        """Initialise NVML; None on success, else the sample that explains why not."""
        job.call = "nvmlInit"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            return NvmlSample(status="no_data", detail=LIBRARY_MISSING_DETAIL)
        except pynvml.NVMLError_DriverNotLoaded as e:
            return NvmlSample(
                status="error",
                error_kind="driver_not_loaded",
                detail=f"nvmlInit: {e}: {LIBRARY_NAME} is installed but the nvidia kernel "
                "module is not loaded",
            )
        except pynvml.NVMLError_FunctionNotFound as e:
            return _too_old("nvmlInit", e, "nvmlInitWithFlags")
        except pynvml.NVMLError as e:
            return NvmlSample(status="error", error_kind="init_failed", detail=f"nvmlInit: {e}")
        self._initialized = True
        self._identity.clear()  # indices may be renumbered after a re-init
        self._static.clear()
        self._lacks.clear()  # a driver reload may bring another library
        return None

    def _shutdown(self, job: _Job) -> NvmlSample:
        job.call = "nvmlShutdown"
        self._initialized = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.debug("nvmlShutdown: %s", e)
        return NvmlSample(status="no_data", detail="NVML shut down")

    def _collect_all(self, job: _Job) -> NvmlSample:
        if not self._initialized:
            failure = self._init(job)
            if failure is not None:
                return failure
        job.call = "nvmlDeviceGetCount"
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError_FunctionNotFound as e:
            self._shutdown(job)
            return _too_old("nvmlDeviceGetCount", e, "nvmlDeviceGetCount_v2")
        except pynvml.NVMLError as e:
            self._shutdown(job)  # node-wide failure: initialise afresh next tick
            return NvmlSample(
                status="error", error_kind=_node_error_kind(e), detail=f"nvmlDeviceGetCount: {e}"
            )
        driver_version = self._system_str(job, "nvmlSystemGetDriverVersion")
        nvml_version = self._system_str(job, "nvmlSystemGetNVMLVersion")
        gpus = []
        for index in range(count):
            try:
                gpu, lacks = _read_gpu(job, index, self._identity.get(index, {}), self._nvlink_due,
                                       self._static.get(index))
            except pynvml.NVMLError_FunctionNotFound as e:
                self._shutdown(job)
                return _too_old("nvmlDeviceGetHandleByIndex", e, "nvmlDeviceGetHandleByIndex_v2")
            for reading, fn_name in lacks.items():
                self._lacks.setdefault(fn_name, set()).add(reading)
            if not gpu.lost and "handle" not in gpu.errors:
                self._static[index] = {k: getattr(gpu, k) for k in STATIC_FIELDS
                                       if getattr(gpu, k) is not None and k not in gpu.errors}
            if not gpu.lost and gpu.uuid is not None:
                self._identity[index] = {k: getattr(gpu, k) for k in _IDENTITY_FIELDS}
            gpus.append(gpu)
        detail = ""
        if self._expected_gpus is not None and count < self._expected_gpus:
            detail = f"{count} of {self._expected_gpus} expected GPUs visible to NVML"
        driver_lacks = {fn: tuple(sorted(readings)) for fn, readings in sorted(self._lacks.items())}
        self._log_lacks(driver_lacks, driver_version)
        return NvmlSample(
            status="ok",
            detail=detail,
            driver_version=driver_version,
            nvml_version=nvml_version,
            count=count,
            gpus=tuple(gpus),
            driver_lacks=driver_lacks,
        )

    def _log_lacks(self, driver_lacks: Mapping[str, tuple[str, ...]], driver_version: str | None) -> None:
        """One warning naming the readings this driver cannot give that no earlier one named."""
        new = {fn: [r for r in readings if (fn, r) not in self._lacks_logged] for fn, readings in driver_lacks.items()}
        new = {fn: readings for fn, readings in new.items() if readings}
        if not new:
            return
        self._lacks_logged.update((fn, r) for fn, readings in new.items() for r in readings)
        log.warning("NVIDIA driver %s: %s; not a fault of the node, these readings are not taken until "
                    "a driver that has the functions is loaded", driver_version or "(version unknown)",
                    lacks_text(new))

    @staticmethod
    def _system_str(job: _Job, fn_name: str) -> str | None:
        job.call = fn_name
        try:
            return getattr(pynvml, fn_name)()
        except pynvml.NVMLError as e:
            log.debug("%s: %s", fn_name, e)
            return None
