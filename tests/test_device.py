"""trimtab.hardware: device and precision choice, and the peak FLOP/s behind MFU."""

import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trimtab import hardware as hw
from trimtab import peaks
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer


def test_cpu_without_native_bf16_trains_in_fp32(monkeypatch):
    monkeypatch.setattr(hw, "cpu_has_native_bf16", lambda: False)
    p = hw.choose_precision(torch.device("cpu"), "auto")
    assert p.name == "fp32" and "no native bf16" in p.reason
    assert p.autocast_dtype is None and p.grad_scaler() is None


def test_cpu_with_bf16_picks_the_faster_measured_dtype_measured_once(tmp_path, monkeypatch):
    monkeypatch.setattr(hw, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path / "a"))
    timed = []
    monkeypatch.setattr(
        hw, "matmul_seconds", lambda dtype, *a: timed.append(dtype) or (1.0 if dtype == torch.float32 else 0.5)
    )
    p = hw.choose_precision(torch.device("cpu"), "auto")
    assert p.name == "bf16" and "2.0x faster" in p.reason and "cached" in p.reason and len(timed) == 2
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "bf16" and len(timed) == 2  # read, not timed
    monkeypatch.setattr(hw, "matmul_seconds", lambda dtype, *a: 0.5 if dtype == torch.float32 else 1.0)
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "bf16"  # the cache's answer
    hw.cpu_precision_path().write_text("{not json")  # a corrupt cache is measured again
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "fp32"
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path / "b"))  # another machine's cache: its own measurement
    monkeypatch.setattr(hw, "matmul_seconds", lambda dtype, *a: 1.0 if dtype == torch.float32 else 0.5)
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "bf16"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count: measured again
    monkeypatch.setattr(hw, "matmul_seconds", lambda dtype, *a: 0.5 if dtype == torch.float32 else 1.0)
    assert hw.choose_precision(torch.device("cpu"), "auto").name == "fp32"


def test_measuring_the_cpu_draws_none_of_the_runs_random_numbers(tmp_path, monkeypatch):
    """The bf16 / fp32 matmuls (and the peak's) draw from their own generator: from the global one,
    a run's initial weights depended on whether this machine's cache held the timings yet."""
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path))
    monkeypatch.setattr(hw, "MATMUL_N", 64)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert hw.timings_valid(hw.cpu_matmul_timings())  # measured: nothing in the cache
    hw.matmul_seconds(torch.float32, 64, 2)
    assert torch.equal(torch.rand(4), expected)


def test_requested_precision_wins_and_fp16_gets_a_scaler():
    p = hw.choose_precision(torch.device("cpu"), "fp16")
    assert p.name == "fp16" and isinstance(p.grad_scaler(), torch.amp.GradScaler)
    with p.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def test_cuda_request_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device=cuda"):
        hw.pick_device("cuda")


def test_gpu_peak_and_memory_come_from_one_table(monkeypatch):
    cuda = hw.Precision(torch.device("cuda"), "bf16", "")
    for name, peak, source in [
        ("NVIDIA H100 80GB HBM3", 989e12, "H100 datasheet (dense bf16)"),
        ("NVIDIA L40S", 362e12, "L40S datasheet (dense bf16)"),  # not L4's
        ("Tesla V100-SXM2-32GB", 125e12, "V100 datasheet (dense fp16)"),  # no bf16 before Ampere
        ("NVIDIA B200", None, "NVIDIA B200: not in hardware.GPUS, peak unknown"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peaks.peak_flops(cuda) == (peak, source)
    assert (hw.GPUS["H100"].peak_flops, hw.GPUS["H100"].memory_gb) == (989e12, 80)


# ---------------------------------------------------------------------- the CPU peak and its cache

CPU = hw.Precision(torch.device("cpu"), "fp32", "")
TODAY = datetime.date.today().isoformat()


@pytest.fixture
def timer(monkeypatch, tmp_path):
    """A fake matmul timer (`timer.seconds` per matmul, calls counted) and a fresh cache file."""
    monkeypatch.setattr(peaks, "cpu_peak_path", lambda: tmp_path / "cpu_peak.json")

    def fake(dtype, n, reps):
        fake.calls += 1
        return fake.seconds

    fake.calls, fake.seconds = 0, 0.5
    monkeypatch.setattr(peaks, "matmul_seconds", fake)
    monkeypatch.setattr(peaks, "cpu_ceiling_flops", lambda precision: None)  # this machine's: a test sets one
    return fake


def rate(seconds):
    return 2 * peaks.CPU_PEAK_N**3 / seconds


def test_cpu_peak_is_measured_once_then_read_from_the_cache(timer):
    threads = torch.get_num_threads()
    expected = (
        f"CPU matmul peak measured {TODAY} (cached, {threads} thread{'s' if threads != 1 else ''} fp32, "
        f"best of {peaks.CPU_PEAK_REPS})"
    )
    assert peaks.peak_flops(CPU) == (rate(0.5), expected) and timer.calls == 1
    timer.seconds = 0.1  # a later start on an idler machine does not measure again
    assert peaks.peak_flops(CPU) == (rate(0.5), expected) and timer.calls == 1
    saved = json.loads(peaks.cpu_peak_path().read_text())
    assert list(saved) == [peaks.cpu_peak_key("fp32")] and hw.cpu_model() in peaks.cpu_peak_key("fp32")


def test_processes_starting_together_on_a_cold_cache_measure_once(timer, monkeypatch, caplog):
    """hardware.measuring: two starts at once (a job's ranks, two test workers) take turns, and
    the second reads the first's entry (flock: two opens of the lock conflict, in one process too);
    a holder that never lets go is waited for `wait_s`, then measured alongside, said."""
    measure = peaks.matmul_seconds

    def slow(dtype, n, reps):
        time.sleep(0.3)  # long enough that the other thread asks while this one measures
        return measure(dtype, n, reps)

    monkeypatch.setattr(peaks, "matmul_seconds", slow)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: peaks.peak_flops(CPU)[0], range(2)))
    assert got == [rate(0.5)] * 2 and timer.calls == 1
    with hw.measuring(peaks.cpu_peak_path()):
        start = time.monotonic()
        with hw.measuring(peaks.cpu_peak_path(), wait_s=0.2):
            waited = time.monotonic() - start
    assert 0.2 <= waited < 5 and "locked past 0 s by a process measuring" in caplog.text


def test_a_lower_measurement_never_replaces_a_higher_cached_peak(timer):
    timer.seconds = 0.25
    assert peaks.measure_cpu_peak("fp32")["flops"] == rate(0.25)
    timer.seconds = 1.0  # a busy moment
    assert peaks.measure_cpu_peak("fp32")["flops"] == rate(0.25)
    assert peaks.peak_flops(CPU)[0] == rate(0.25)
    timer.seconds = 0.2  # a quieter one raises it
    assert peaks.measure_cpu_peak("fp32")["flops"] == peaks.peak_flops(CPU)[0] == rate(0.2)
    assert timer.calls == 3


def test_the_cpu_peak_is_kept_per_thread_count(timer):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = peaks.peak_flops(CPU)
        torch.set_num_threads(2)
        timer.seconds = 0.3
        two = peaks.peak_flops(CPU)
    finally:
        torch.set_num_threads(before)
    assert timer.calls == 2 and one[0] == rate(0.5) and two[0] == rate(0.3)
    assert "1 thread fp32" in one[1] and "2 threads fp32" in two[1]
    assert len(json.loads(peaks.cpu_peak_path().read_text())) == 2


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"KEY": {"flops": "fast"}}'])
def test_a_corrupt_cache_is_ignored_and_rewritten(timer, text):
    peaks.cpu_peak_path().write_text(text.replace("KEY", peaks.cpu_peak_key("fp32")))
    assert peaks.peak_flops(CPU)[0] == rate(0.5) and timer.calls == 1
    assert json.loads(peaks.cpu_peak_path().read_text())[peaks.cpu_peak_key("fp32")]["flops"] == rate(0.5)


def test_emulated_cpu_dtypes_have_no_peak_and_are_not_timed(timer, monkeypatch):
    monkeypatch.setattr(peaks, "cpu_has_native_bf16", lambda: False)
    assert peaks.peak_flops(hw.Precision(torch.device("cpu"), "fp16", ""))[0] is None
    assert peaks.peak_flops(hw.Precision(torch.device("cpu"), "bf16", "")) == (
        None,
        "CPU bf16 is emulated on this CPU: no peak",
    )
    assert timer.calls == 0


def test_a_real_measurement_lands_in_trimtab_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path))
    monkeypatch.setattr(peaks, "CPU_PEAK_N", 256)  # a quick real matmul: the arithmetic, not the peak
    monkeypatch.setattr(peaks, "CPU_PEAK_REPS", 2)
    flops, source = peaks.peak_flops(CPU)
    assert flops > 1e8 and "best of 2" in source
    assert peaks.cpu_peak_key("fp32") in json.loads((tmp_path / "cpu_peak.json").read_text())


def four_fp32_steps(tmp_path):
    """A 4-step fp32 debug run: (its trainer, its summary, its metrics.jsonl lines)."""
    sections = {
        "out": str(tmp_path / "run"),
        # eager: train.compile=auto would compile where a test's peak is 1 FLOP/s (a "long" run)
        "train": {"max_steps": 4, "log_every": 2, "eval_every": 0, "precision": "fp32", "compile": "false"},
        "data": {"max_bytes": 150_000},
        "log": {"progress": False, "tensorboard": False},
    }
    trainer = Trainer(setup(load_config(preset="debug", overrides=sections)))
    summary = trainer.fit()
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, summary, lines


def test_the_trainer_measures_mfu_against_the_cached_peak(timer, tmp_path, one_thread):
    """No measurement at start: the cached value is the reference in metrics.jsonl and the summary."""
    peak = 1e15  # no run beats it
    entry = {"flops": peak, "measured": "2026-01-01", "reps": 10, "threads": 1, "precision": "fp32"}
    peaks.cpu_peak_path().write_text(json.dumps({peaks.cpu_peak_key("fp32"): entry}))
    trainer, summary, lines = four_fp32_steps(tmp_path)
    assert timer.calls == 0
    fpt = trainer.flops_per_token
    logged = [m for m in lines if "tokens_per_s" in m]
    assert len(logged) == 2 and all(m["mfu"] == pytest.approx(m["tokens_per_s"] * fpt / peak) for m in logged)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / peak)
    assert summary["peak_flops_source"] == "CPU matmul peak measured 2026-01-01 (cached, 1 thread fp32, best of 10)"


def write_peak(flops, **extra):
    entry = {"flops": flops, "measured": "2026-01-01", "reps": 10, "threads": 1, "precision": "fp32", **extra}
    peaks.cpu_peak_path().write_text(json.dumps({peaks.cpu_peak_key("fp32"): entry}))


def cached_peak():
    return json.loads(peaks.cpu_peak_path().read_text())[peaks.cpu_peak_key("fp32")]


def test_a_cached_peak_far_under_the_cpus_ceiling_is_measured_again_once(timer, monkeypatch):
    """Issue #30: a peak cached on a busy machine was never raised and runs reported MFU 116%."""
    monkeypatch.setattr(peaks, "cpu_ceiling_flops", lambda precision: rate(0.5) * 2)
    write_peak(rate(0.5) / 100)  # 1/200 of the ceiling: implausible
    assert peaks.peak_flops(CPU)[0] == rate(0.5) and timer.calls == 1
    assert cached_peak()["flops"] == rate(0.5)
    write_peak(rate(0.5) / 100)  # measured again and as low: this CPU is that slow, keep it, stop asking
    timer.seconds = 50.0
    assert peaks.peak_flops(CPU)[0] == rate(0.5) / 100 and timer.calls == 2
    assert cached_peak()["rechecked"] is True
    assert peaks.peak_flops(CPU)[0] == rate(0.5) / 100 and timer.calls == 2


def test_a_peak_above_the_cpus_ceiling_is_not_believed(timer, monkeypatch):
    monkeypatch.setattr(peaks, "cpu_ceiling_flops", lambda precision: rate(0.5))
    write_peak(rate(0.5) * 10)  # a bad timer
    timer.seconds = 0.1  # measures above the ceiling too: the ceiling is the most it can be
    assert peaks.peak_flops(CPU)[0] == rate(0.5) and timer.calls == 1
    assert cached_peak()["flops"] == rate(0.5)


FAKE_CPUINFO = """processor\t: 0
model name\t: Fake CPU
cpu MHz\t\t: 2500.000
flags\t\t: fpu sse2 avx FLAGS
"""


@pytest.mark.parametrize(
    ("flags", "precision", "per_cycle"),
    [("fma avx2", "fp32", 32), ("fma avx512f", "fp32", 64), ("", "fp32", 16), ("avx512_bf16 amx_bf16", "bf16", 2048)],
)
def test_the_cpu_ceiling_is_threads_x_clock_x_flops_per_cycle(monkeypatch, tmp_path, flags, precision, per_cycle):
    monkeypatch.setattr(peaks, "read_cpuinfo", lambda: FAKE_CPUINFO.replace("FLAGS", flags))
    monkeypatch.setattr(peaks, "CPUFREQ_MAX", tmp_path / "absent")  # a VM: the MHz line and a turbo margin
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert peaks.cpu_ceiling_flops(precision) == 2.5e9 * peaks.TURBO_MARGIN * per_cycle
    (tmp_path / "max").write_text("3800000\n")  # kHz
    monkeypatch.setattr(peaks, "CPUFREQ_MAX", tmp_path / "max")
    assert peaks.cpu_ceiling_flops(precision) == 3.8e9 * per_cycle


def test_a_cpu_ceiling_is_unknown_without_flags(monkeypatch):
    monkeypatch.setattr(peaks, "read_cpuinfo", lambda: "processor\t: 0\nFeatures\t: fp asimd\n")  # arm64
    assert peaks.cpu_ceiling_flops("fp32") is None


def test_a_run_faster_than_the_cached_peak_raises_it(timer, monkeypatch):
    monkeypatch.setattr(peaks, "cpu_ceiling_flops", lambda precision: 1e10)
    write_peak(1e9)
    peak, source = peaks.beaten_peak(CPU, 3e9, *peaks.peak_flops(CPU))
    assert peak == 3e9 and cached_peak()["flops"] == 3e9 and source.startswith("CPU peak raised to a run's own rate")
    assert peaks.peak_flops(CPU) == (peak, source) and timer.calls == 0
    assert peaks.beaten_peak(CPU, 5e10, peak, source) == (peak, source)  # over the ceiling: the FLOP count is off
    cuda = hw.Precision(torch.device("cuda"), "bf16", "")
    assert peaks.beaten_peak(cuda, 2e15, 989e12, "H100 datasheet") == (989e12, "H100 datasheet")


def test_mfu_never_exceeds_one_and_the_run_raises_a_low_cached_peak(timer, tmp_path, one_thread):
    write_peak(1.0, rechecked=True)  # 1 FLOP/s: every step beats it
    trainer, summary, lines = four_fp32_steps(tmp_path)
    mfus = [m["mfu"] for m in lines if "mfu" in m] + [summary["mfu"]]
    assert len(mfus) == 3 and all(0 < m <= 1 for m in mfus) and mfus[0] == 1.0
    assert cached_peak()["flops"] == trainer.peak_flops > 1.0 and cached_peak()["source"] == "run"
    assert summary["peak_flops_source"].startswith("CPU peak raised to a run's own rate")
    assert timer.calls == 0


def test_mps_request_without_mps_is_a_config_error_naming_the_key_and_choices(monkeypatch):
    """train.device=mps on a machine without it was torch's error at the first tensor (a traceback);
    it is refused as cuda is, naming the key (doctor's flag for doctor) and the choices."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^train.device=mps .*use auto or cpu \(choices: auto, cpu, cuda, mps\)"):
        hw.pick_device("mps")
    with pytest.raises(ConfigError, match=r"^--device=mps "):
        hw.pick_device("mps", key="--device")
