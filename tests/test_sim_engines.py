"""Engine versions the calibration does not cover are said, never silently estimated: the
estimate's "calibration" field and a warning on stderr; an unknown version is an error that
lists the known ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_sim  # noqa: E402

EST = [sys.executable, os.path.join(ROOT, "otela_sim.py"), "estimate", "--model", "llama-2-7b", "--gpu", "A100-80GB",
       "--batch", "8", "--json"]


def estimate(*extra, env=None):
    out = subprocess.run(EST + list(extra), capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **(env or {})))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_an_engine_row_no_measurement_was_fitted_to_is_reported_with_a_warning():
    e, err = estimate("--engine", "trtllm-0.10")
    assert e["calibration"] == {"row": "trtllm-0.10", "fitted": False, "fitted_on": [],
                                "note": "no fitted calibration row for trtllm-0.10: its engine parameters are "
                                        "priors, not fitted to any measurement"}
    assert err.strip() == "otela_sim.py: warning: " + e["calibration"]["note"]


def test_a_release_without_fitted_rows_says_which_row_stands_in_for_it():
    e, err = estimate("--engine", "vllm", "--engine-version", "0.11.1")
    assert e["engine_version"] == "vllm-v1"
    assert e["calibration"]["fitted"] is False and e["calibration"]["fitted_on"] == ["0.20.1", "0.23.0"]
    assert "no fitted calibration row for vllm 0.11.1" in err and len(err.strip().splitlines()) == 1


def test_a_fitted_engine_version_is_reported_fitted_and_warns_nothing():
    e, err = estimate("--engine", "sglang", "--engine-version", "0.5.6")
    assert e["calibration"]["fitted"] is True and e["calibration"]["fitted_on"] == ["0.5.6"]
    assert err == ""


def test_with_the_calibration_off_every_engine_is_reported_on_its_priors():
    e, err = estimate("--engine", "vllm-0.6", env={"OTELA_CALIBRATION": "none"})
    assert e["calibration"]["fitted"] is False and "priors" in err


def test_an_unknown_engine_version_is_an_error_listing_the_known_ones():
    out = subprocess.run(EST + ["--engine", "vllm", "--engine-version", "latest"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert "unknown vllm version 'latest'" in out.stderr
    assert all(k in out.stderr for k in ("vllm-0.4", "vllm-0.6", "vllm-v1"))


def test_engine_coverage_compares_major_and_minor_releases_of_the_fitted_rows():
    ev = otela_sim.ENGINE_VERSIONS["trtllm-0.6"]
    rows = [{"engine": "TensorRT-LLM", "engine_version": "0.6.1", "inconsistent": "", "held_out": ""},
            {"engine": "TensorRT-LLM", "engine_version": "0.7.0", "inconsistent": "", "held_out": "yes"}]
    cal = otela_sim.merge_calibration(otela_sim.DEFAULT_CALIBRATION, {})  # a calibration that is not the priors
    assert otela_sim.engine_coverage(ev, "0.6.0", rows, cal)["fitted"] is True
    held = otela_sim.engine_coverage(ev, "0.7.0", rows, cal)  # a held-out row is no fitted row
    assert held["fitted"] is False and held["fitted_on"] == ["0.6.1"]
    assert otela_sim.engine_coverage(ev, None, None, cal)["fitted"] is None


@pytest.mark.parametrize("flag", ["--tp", "--batch", "--input", "--output", "--replicas"])
def test_estimate_counts_below_one_are_refused(flag):
    out = subprocess.run(EST + [flag, "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"argument {flag}: 0 must be >= 1" in out.stderr
