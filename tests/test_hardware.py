"""hardware.py: CPU flags, VNNI detection, the results.json ``hardware`` section."""

from __future__ import annotations

import pytest

from quantnorm import hardware
from quantnorm.measure import sessions

CPUINFO_VNNI = """processor\t: 0
model name\t: Test CPU 9000
flags\t\t: fpu vme sse sse2 sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_vnni amx_int8 sha_ni
"""
CPUINFO_AVX2 = """processor\t: 0
model name\t: Old AVX2 CPU
flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2
"""


@pytest.fixture
def fake_cpuinfo(tmp_path, monkeypatch):
    """Point hardware at a fake /proc/cpuinfo (and clear its cache before and after)."""

    def use(text: str | None):
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(hardware, "CPUINFO", path)
        hardware._all_cpu_flags.cache_clear()

    yield use
    hardware._all_cpu_flags.cache_clear()


def test_flags_keep_only_isa_flags_that_matter(fake_cpuinfo):
    fake_cpuinfo(CPUINFO_VNNI)
    flags = hardware.cpu_flags()
    assert flags == sorted(flags)
    assert {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "amx_int8"} == set(flags)
    assert "fpu" not in flags and "sha_ni" not in flags and "sse4_1" not in flags
    assert hardware.cpu_has_vnni() is True
    assert hardware.cpu_model() == "Test CPU 9000"


def test_avx2_without_vnni(fake_cpuinfo):
    fake_cpuinfo(CPUINFO_AVX2)
    assert hardware.cpu_flags() == ["avx", "avx2", "f16c", "fma", "sse4_2"]
    assert hardware.cpu_has_vnni() is False


def test_avx_vnni_alone_counts(fake_cpuinfo):
    fake_cpuinfo("flags\t: avx avx2 avx_vnni\n")
    assert hardware.cpu_has_vnni() is True


def test_unknown_cpuinfo_means_no_flags_and_no_vnni(fake_cpuinfo):
    fake_cpuinfo(None)  # file does not exist
    assert hardware.cpu_flags() == []
    assert hardware.cpu_has_vnni() is False
    assert isinstance(hardware.cpu_model(), str) and hardware.cpu_model()


CPUINFO_ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: avx avx2 avx512f avx512_vnni avx512_vp2intersect
"""


def test_cpu_id_tells_one_model_name_apart(fake_cpuinfo):
    fake_cpuinfo(CPUINFO_ZEN5)
    assert hardware.cpu_model() == "AMD EPYC"
    assert hardware.cpu_id() == "AuthenticAMD family 26 model 2 stepping 1"
    fake_cpuinfo(CPUINFO_AVX2)  # no family or model listed
    assert hardware.cpu_id() is None


def test_cpu_caches_read_sysfs_without_instruction_caches(tmp_path, monkeypatch):
    for index, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "32K"),
                                                   ("3", "Unified", "32768K"), ("2", "Unified", "1024K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    monkeypatch.setattr(hardware, "CPU_CACHE_DIR", tmp_path)
    assert hardware.cpu_caches() == "L1d 48K, L2 1024K, L3 32768K"
    monkeypatch.setattr(hardware, "CPU_CACHE_DIR", tmp_path / "absent")
    assert hardware.cpu_caches() is None


def test_real_machine_flags_are_consistent():
    hardware._all_cpu_flags.cache_clear()
    flags = set(hardware.cpu_flags())
    assert hardware.cpu_has_vnni() == bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "amx_bf16"})


def test_hardware_info_has_the_contract_keys():
    import onnxruntime as ort

    info = sessions.hardware_info(threads=2)
    for key in ("cpu", "cpu_id", "cpu_caches", "cpu_flags", "vnni", "threads", "onnxruntime", "torch", "onnx", "numpy", "python",
                "providers_available", "gpu", "os"):
        assert key in info, key
    assert info["threads"] == 2
    assert info["onnxruntime"] == ort.__version__
    assert info["providers_available"] == ort.get_available_providers()
    assert isinstance(info["vnni"], bool)
    # Each listed provider is either usable or has a reason; CPU is always usable.
    assert info["providers_status"]["CPUExecutionProvider"] == "usable"
    assert set(info["providers_status"]) == set(info["providers_available"])
    assert sessions.hardware_info()["threads"] == hardware.available_cpus()


def test_gpu_is_none_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    hardware.gpu_names.cache_clear()
    try:
        assert hardware.gpu_names() == ()
        assert sessions.hardware_info(probe_providers=False)["gpu"] is None
    finally:
        hardware.gpu_names.cache_clear()


def test_gpu_name_from_nvidia_smi(monkeypatch):
    class Done:
        returncode = 0
        stdout = "NVIDIA H200\n"

    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(hardware.subprocess, "run", lambda *a, **k: Done())
    hardware.gpu_names.cache_clear()
    try:
        assert sessions.hardware_info(probe_providers=False)["gpu"] == "NVIDIA H200"
        assert hardware.gpu_device_present()
    finally:
        hardware.gpu_names.cache_clear()


def test_report_names_the_cpu_family_and_caches_where_recorded():
    from quantnorm.report import sections

    hw = {"cpu": "AMD EPYC", "cpu_id": "AuthenticAMD family 26 model 2 stepping 1",
          "cpu_caches": "L1d 48K, L2 1024K, L3 32768K", "cpu_flags": ["avx2"], "vnni": True, "threads": 2}
    text = "\n".join(sections.hardware({"hardware": hw}))
    assert "| CPU family | AuthenticAMD family 26 model 2 stepping 1 |" in text
    assert "L3 32768K" in text
    older = "\n".join(sections.hardware({"hardware": {k: v for k, v in hw.items() if k not in ("cpu_id", "cpu_caches")}}))
    assert "CPU family" not in older and "caches" not in older
