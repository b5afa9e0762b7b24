"""The sibling scenario with a real language model making every decision,
once with local delivery and once over an IOA network. The model server is
started by the harness (agent_host/local_model) from the binary and weights that the
suite's set-up prepared before pytest started (scripts/test.sh runs
harness.prepare); when they are missing the test fails at once naming that
command, and nothing is built here. INBOXMESH_SCENARIO_LLM points the same
scenario at any other OpenAI-compatible endpoint. Each run writes a report
under results/real-llm/."""

import tempfile
from pathlib import Path

import pytest

from harness.prepare import NotPrepared, prepared, scenario_endpoint
from harness.real_llm import run_once, scenario_mesh, scenario_model


@pytest.fixture
async def model():
    if not scenario_endpoint():
        try:
            prepared()
        except NotPrepared as exc:  # a failure, not a skip: a skip would hide a broken set-up
            pytest.fail(str(exc), pytrace=False)
    async with scenario_model() as m:
        yield m


@pytest.mark.parametrize("via_ioa", [False, True], ids=["local", "ioa"])
@pytest.mark.timeout(1200)  # the wall-time budget (600 s) and the mesh around it; nothing is built here
async def test_the_sibling_exchange_with_a_real_model(model, via_ioa, spans):
    with tempfile.TemporaryDirectory(prefix="real-llm-") as tmp:
        async with scenario_mesh(Path(tmp), via_ioa) as (mesh, client):
            result = await run_once(mesh.address, model, Path(tmp) / "host", via_ioa=via_ioa, client=client,
                                    spans=spans, label="ci")
    print(f"real-model report: {result.report}")
    assert result.ok, f"{result.problems} (report: {result.report})"
