"""Sample the GPU's SM clock, power, temperature and throttle reasons while a benchmark runs.

A step that takes 10-30% longer now and then can be the GPU (clocks pulled down by the power cap
or heat) or the host (the CPU fell behind and the GPU waited). This tells the first apart:

    with GpuSampler.for_device(0) as sampler:     # a thread reads NVML every 20 ms
        ... timed steps ...
    sampler.summary()  # {'sm_mhz_min': 1755, 'sm_mhz_median': 1980, 'power_w_max': 688.0, ...}

``for_device`` reads NVML through ``pynvml`` (``nvidia-ml-py``) with the handle PyTorch uses for
that device (so ``CUDA_VISIBLE_DEVICES`` is respected); without ``pynvml`` it returns a sampler
that records nothing and reports ``{}``. The sampling loop and the summary are plain Python,
tested on CPU with a fake reader.
"""

from __future__ import annotations

import statistics
import threading
from typing import Callable, Optional

# NVML clocks-event (throttle) reason bits, nvml.h: why the clocks are below their maximum.
THROTTLE_REASONS = {
    0x1: "gpu idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}

Sample = tuple[float, float, float, int]  # SM clock MHz, power W, temperature C, throttle-reason bits


def throttle_names(bits: int) -> list[str]:
    """The NVML throttle reasons set in ``bits``, by name (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if bits & bit]
    unknown = bits & ~sum(THROTTLE_REASONS)
    return names + ([hex(unknown)] if unknown else [])


class GpuSampler:
    """Calls ``read()`` every ``interval_s`` seconds on a daemon thread between ``start`` and ``stop``."""

    def __init__(self, read: Optional[Callable[[], Sample]], interval_s: float = 0.02) -> None:
        self.read = read
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_device(cls, device: int = 0, interval_s: float = 0.02) -> "GpuSampler":
        """A sampler of CUDA device ``device`` through NVML, or an inert one when NVML is missing."""
        try:
            import pynvml
            import torch

            handle = torch.cuda._get_pynvml_handler(device)  # the physical GPU behind this torch index
            reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

            def read() -> Sample:
                return (float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                        float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                        int(reasons(handle)))

            read()  # fail here, not on the thread
            return cls(read, interval_s)
        except Exception:  # noqa: BLE001 - monitoring is optional, never fatal to a benchmark
            return cls(None, interval_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:  # noqa: BLE001 - a failed read ends the sampling, not the benchmark
                return
            self._stop.wait(self.interval_s)

    def start(self) -> "GpuSampler":
        if self.read is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None

    def __enter__(self) -> "GpuSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        """Min / median / max SM clock, median / max power, max temperature, and the throttle
        reasons seen with the share of samples that had each. ``{}`` when nothing was sampled."""
        if not self.samples:
            return {}
        clocks = [s[0] for s in self.samples]
        power = [s[1] for s in self.samples]
        seen: dict[str, int] = {}
        for sample in self.samples:
            for name in throttle_names(sample[3]):
                seen[name] = seen.get(name, 0) + 1
        return dict(
            samples=len(self.samples),
            sm_mhz_min=min(clocks), sm_mhz_median=statistics.median(clocks), sm_mhz_max=max(clocks),
            power_w_median=round(statistics.median(power), 1), power_w_max=round(max(power), 1),
            temp_c_max=max(s[2] for s in self.samples),
            throttle={name: round(count / len(self.samples), 3) for name, count in sorted(seen.items())},
        )

