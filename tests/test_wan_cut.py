"""A site cut off (root; the WAN lab): sites a and b, each with its ingress on its login host and a
node serving the same model behind its NAT, lose their WAN link for a while (wanlab.run_site_cut,
also a `make reliability` row with a longer cut)."""
from __future__ import annotations

import json

import pytest
import reliability as rel
import wanlab


@pytest.mark.root
def test_a_site_cut_off_serves_its_own_users_and_keys_and_usage_agree_after_the_heal(tmp_path):
    reason = wanlab.unavailable()
    if reason:
        pytest.skip(reason)
    out = wanlab.run_site_cut(str(tmp_path), dict(rel.QUICK_TIMINGS), cut_s=20.0)
    print(json.dumps(out, indent=1))
    assert all(v["errors"] == 0 for v in out["during"].values()), out["during"]
    assert all(v["errors"] == 0 for v in out["after"].values()), out["after"]
    assert out["revoke_status"] == 200 and out["made_works_at_a_during"] and out["doomed_refused_at_b_during"]
    assert out["made_works_at_b_after_s"] is not None and out["doomed_refused_at_a_after_s"] is not None, out
    budget = out["budget"]
    # each side spends what was left at the cut (all of it) and may pass it by its last answer (a few tokens)
    assert budget["spent_total"]["a"] == budget["spent_total"]["b"] <= 2 * (wanlab.CUT_BUDGET_TOKENS + 20), budget
    assert budget["refused_at_both_after"], budget
    usage = out["usage"]
    assert usage["at_a"] == usage["at_b"], usage
    assert usage["at_a"]["requests"] == usage["answered_in_test"], usage   # each answer counted once
