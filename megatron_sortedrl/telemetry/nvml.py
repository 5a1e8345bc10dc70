"""NVML sampler: a background thread that samples every GPU of its node on the run clock, and the reader
of the sample files it writes.

Usage (the driver does this on every node with GPUs; `tools/nvml_record.py` does it around any command)::

    sampler = NvmlSampler(run_dir / "nvml" / f"{host}.jsonl", clock=RunClock(epoch), interval_s=0.1)
    sampler.start()        # False, after one line "NVML unavailable: ...", where there is no NVIDIA driver
    ...
    stats = sampler.stop() # the sampler's own cost: seconds per sample, CPU fraction of one core

Sample file (JSON lines): a `{"meta": {...}}` line (host, run epoch, interval, driver, one entry per
GPU with name, uuid, memory total, power limit), then one line per GPU per tick::

    {"t": 12.3, "host": "node0", "gpu": 0, "util": 97, "mem_util": 41, "mem_used_mib": 30512.0,
     "power_w": 612.5, "sm_clock_mhz": 1980, "temp_c": 61}

and, when the sampler stops cleanly, an `{"overhead": {...}}` line. `t` is on the same clock as the
timeline (`RunClock`). A field the GPU does not support is left out of its row. `read_samples` also
reads a CSV with these column names, and the CSV of
`nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw,clocks.sm,temperature.gpu
--format=csv -lms 100` (its timestamps become seconds since its first row).

`util` is NVML's utilization rate: the percentage of the last sample period in which at least one
kernel ran on the GPU. It is not SM occupancy: a single small kernel reads as 100 %. It does show
bubbles, which is what the report is for. Left out: GPM/DCGM SM-activity and tensor-core metrics,
per-process accounting, MIG instances (sampled as their parent GPU).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from megatron_sortedrl.telemetry.timeline import RunClock

log = logging.getLogger(__name__)

FIELDS = ("util", "mem_util", "mem_used_mib", "power_w", "sm_clock_mhz", "temp_c")
UNAVAILABLE = "NVML unavailable: {reason}; continuing without GPU utilization sampling"
MIB = 1024 * 1024


def nvml_init() -> tuple[Any, str | None]:
    """(pynvml module, None) after a successful nvmlInit, or (None, reason) where NVML cannot start."""
    try:
        import pynvml  # provided by the nvidia-ml-py package
    except ImportError as exc:
        return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses, or OSError from a broken driver install
        return None, str(exc) or type(exc).__name__
    return pynvml, None


def _read(fn: Any, *args: Any) -> Any:
    """One NVML query; None where the GPU does not support it (consumer cards lack power readings)."""
    try:
        return fn(*args)
    except Exception:
        return None


@dataclass
class SamplerStats:
    """What sampling cost: measured inside the sampling thread."""

    ticks: int = 0  # sampling rounds (each covers every GPU)
    rows: int = 0  # rows written (ticks x GPUs)
    wall_s: float = 0.0  # seconds the sampler ran
    busy_s: float = 0.0  # wall seconds spent inside NVML queries and writing
    cpu_s: float = 0.0  # CPU seconds of the sampling thread
    late_ticks: int = 0  # ticks that started more than one interval late (host overloaded)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        per_tick_ms = 1000 * self.busy_s / self.ticks if self.ticks else 0.0
        cpu_fraction = self.cpu_s / self.wall_s if self.wall_s else 0.0
        return {"ticks": self.ticks, "rows": self.rows, "wall_s": round(self.wall_s, 3),
                "busy_s": round(self.busy_s, 4), "cpu_s": round(self.cpu_s, 4),
                "ms_per_tick": round(per_tick_ms, 4), "cpu_fraction_of_one_core": round(cpu_fraction, 5),
                "late_ticks": self.late_ticks, **self.extra}


class NvmlSampler:
    """Samples every GPU NVML sees on this node (NVML ignores CUDA_VISIBLE_DEVICES, so a sampler started
    from a process that owns no GPU still sees the whole node) every `interval_s` seconds."""

    def __init__(self, path: str | os.PathLike, clock: RunClock | None = None, interval_s: float = 0.1,
                 host: str | None = None, gpus: list[int] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.path = Path(path)
        self.clock = clock or RunClock()
        self.interval_s = interval_s
        self.host = host or socket.gethostname()
        self.gpus = gpus
        self.stats = SamplerStats()
        self.unavailable_reason: str | None = None
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._file: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Start sampling; False (after one logged line) where NVML or any GPU is unavailable."""
        nvml, reason = nvml_init()
        if nvml is not None:
            count = nvml.nvmlDeviceGetCount()
            indices = [i for i in range(count) if self.gpus is None or i in self.gpus]
            if not indices:
                reason = "no GPU found by NVML" if count == 0 else f"none of GPUs {self.gpus} exist (node has {count})"
                _read(nvml.nvmlShutdown)
        if reason is not None:
            self.unavailable_reason = reason
            log.warning(UNAVAILABLE.format(reason=reason))
            return False
        self._nvml = nvml
        self._handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps({"meta": self._meta()}) + "\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._loop, name=f"nvml-sampler-{self.host}", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> dict:
        """Stop, write the overhead line, release NVML; returns `stats.as_dict()` (also when never started)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.write(json.dumps({"overhead": self.stats.as_dict()}) + "\n")
            self._file.close()
            self._file = None
        if self._nvml is not None:
            _read(self._nvml.nvmlShutdown)
            self._nvml = None
        return self.stats.as_dict()

    def __enter__(self) -> NvmlSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sampling --------------------------------------------------------------------------------------

    def _meta(self) -> dict:
        nvml = self._nvml
        gpus = []
        for i, h in self._handles:
            mem = _read(nvml.nvmlDeviceGetMemoryInfo, h)
            limit = _read(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            gpus.append({"index": i, "name": _text(_read(nvml.nvmlDeviceGetName, h)),
                         "uuid": _text(_read(nvml.nvmlDeviceGetUUID, h)),
                         "mem_total_mib": None if mem is None else round(mem.total / MIB, 1),
                         "power_limit_w": None if limit is None else limit / 1000})
        return {"host": self.host, "epoch": self.clock.epoch, "interval_s": self.interval_s,
                "driver": _text(_read(nvml.nvmlSystemGetDriverVersion)), "gpus": gpus}

    def sample_once(self) -> list[dict]:
        """One row per GPU, stamped with the run clock; missing readings are left out of the row."""
        nvml, t = self._nvml, round(self.clock.now(), 4)
        rows = []
        for i, h in self._handles:
            row: dict[str, Any] = {"t": t, "host": self.host, "gpu": i}
            util = _read(nvml.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                row["util"], row["mem_util"] = util.gpu, util.memory
            mem = _read(nvml.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                row["mem_used_mib"] = round(mem.used / MIB, 1)
            power = _read(nvml.nvmlDeviceGetPowerUsage, h)
            if power is not None:
                row["power_w"] = power / 1000
            clock = _read(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
            if clock is not None:
                row["sm_clock_mhz"] = clock
            temp = _read(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
            if temp is not None:
                row["temp_c"] = temp
            rows.append(row)
        return rows

    def _loop(self) -> None:
        assert self._file is not None
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        next_tick = wall0
        while not self._stop.is_set():
            t0 = time.perf_counter()
            if t0 - next_tick > self.interval_s:
                # Skip missed ticks instead of bursting to catch up: a burst would add load exactly
                # when the host is already overloaded.
                self.stats.late_ticks += 1
                next_tick = t0
            rows = self.sample_once()
            # One write per tick, no flush: the OS buffer is enough and flushing at 10 Hz per node costs
            # more than sampling. A crash loses at most the unflushed tail.
            self._file.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
            self.stats.ticks += 1
            self.stats.rows += len(rows)
            self.stats.busy_s += time.perf_counter() - t0
            next_tick += self.interval_s
            self._stop.wait(max(0.0, next_tick - time.perf_counter()))
        self.stats.wall_s = time.perf_counter() - wall0
        self.stats.cpu_s = time.thread_time() - cpu0


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


# ----------------------------------------------------------------------------------------------------
# Reading sample files.


@dataclass
class Samples:
    """The rows of one or more sample files, plus their meta and overhead lines."""

    rows: list[dict]  # each: t, host, gpu, and any of FIELDS
    meta: list[dict] = field(default_factory=list)
    overhead: list[dict] = field(default_factory=list)

    def gpu_keys(self) -> list[tuple[str, int]]:
        return sorted({(r["host"], r["gpu"]) for r in self.rows})


def read_samples(path: str | os.PathLike) -> Samples:
    """Read a sample file (.jsonl from `NvmlSampler`, .csv) or every `*.jsonl`/`*.csv` of a directory."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".csv"))
        out = Samples(rows=[])
        for p in files:
            part = read_samples(p)
            out.rows.extend(part.rows)
            out.meta.extend(part.meta)
            out.overhead.extend(part.overhead)
        out.rows.sort(key=lambda r: r["t"])
        return out
    if path.suffix == ".csv":
        return Samples(rows=_read_csv(path))
    out = Samples(rows=[])
    lines = path.read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            # The last line of a file whose writer was killed may be cut short; anything else is an error.
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: malformed sample line ({exc})") from None
        if "meta" in obj:
            out.meta.append(obj["meta"])
        elif "overhead" in obj:
            out.overhead.append(obj["overhead"])
        else:
            obj.setdefault("host", path.stem)
            out.rows.append(obj)
    return out


# nvidia-smi --format=csv header names (units stripped) -> our field names.
_SMI_COLUMNS = {"index": "gpu", "utilization.gpu": "util", "utilization.memory": "mem_util",
                "memory.used": "mem_used_mib", "power.draw": "power_w", "clocks.sm": "sm_clock_mhz",
                "clocks.current.sm": "sm_clock_mhz", "temperature.gpu": "temp_c"}


def _read_csv(path: Path) -> list[dict]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, skipinitialspace=True)
        header = [h.split(" [")[0].strip() for h in next(reader)]
        names = [_SMI_COLUMNS.get(h, h) for h in header]
        t0 = None
        for lineno, values in enumerate(reader, 2):
            if not values:
                continue
            row: dict[str, Any] = {}
            for name, value in zip(names, values):
                value = value.strip()
                if name == "timestamp":
                    ts = datetime.strptime(value, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    t0 = ts if t0 is None else t0
                    row["t"] = ts - t0
                elif name in ("t", "gpu", *FIELDS):
                    number = value.split(" ")[0]
                    if number in ("", "[N/A]", "N/A", "[Not"):
                        continue
                    try:
                        row[name] = float(number) if name not in ("gpu",) else int(number)
                    except ValueError:
                        raise ValueError(f"{path}:{lineno}: bad {name} value {value!r}") from None
                elif name == "host":
                    row["host"] = value
            if "t" not in row or "gpu" not in row:
                raise ValueError(f"{path}:{lineno}: a row needs a time (t or timestamp) and a GPU index")
            row.setdefault("host", path.stem)
            rows.append(row)
    return rows
