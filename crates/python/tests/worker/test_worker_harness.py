"""The worker harness itself, on the toy connector (tests/vllm/toy_connector.py), which moves
no bytes: a real scheduler step reaches a worker process through vLLM's own connector
lifecycle, the "prefill" writes the request's blocks there, and the block bytes come back."""

import sched_harness
from engines import LAYERS, Engine


def test_scheduler_output_reaches_worker_and_prefill_writes_the_blocks(tmp_path):
    config = sched_harness.create_vllm_config(
        kv_connector="ToyConnector", kv_connector_module_path="toy_connector",
        kv_role="kv_producer",
    )
    p = Engine("p", config, num_blocks=32, log_dir=tmp_path, seed=1).ready()
    try:
        layout = p.worker.request("layout")
        assert sorted(layout) == sorted(LAYERS)
        # vLLM 0.33 per-layer view: [blocks, kv heads, block size, 2 * head size].
        assert all(shape == (32, 4, 16, 32) for shape, *_ in layout.values())

        req = sched_harness.create_request(
            num_tokens=40, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        p.add_request(req)
        p.step(fill_new=True)
        params = p.outputs[req.request_id].kv_transfer_params
        blocks = params["remote_block_ids"]
        assert blocks == p.block_ids(req.request_id) and len(blocks) == 3

        pages = p.worker.request("blocks", block_ids=blocks + [blocks[-1] + 1])
        for layer in LAYERS:
            written, untouched = pages[layer][:3], pages[layer][3]
            assert len(set(written)) == 3 and all(any(page) for page in written)
            assert not any(untouched)
        assert pages[LAYERS[0]][:3] != pages[LAYERS[1]][:3]
    finally:
        p.close()
