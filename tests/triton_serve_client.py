"""Client side of tests/test_triton_serve.py, run under the serving interpreter (it has tritonclient[grpc,http]):
sends the requests of REQUESTS.npz concurrently over gRPC and HTTP, then the bad requests, then one more good
request; writes the answers to OUT.npz and the errors to OUT.json.

usage: python triton_serve_client.py MODEL_NAME HTTP_URL GRPC_URL REQUESTS.npz OUT.npz OUT.json
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def infer(mod, url, model, feeds, dtype_override=None):
    client = mod.InferenceServerClient(url)
    try:
        inputs = []
        for name, arr in feeds.items():
            dt = (dtype_override or {}).get(name, "INT64")
            i = mod.InferInput(name, list(arr.shape), dt)
            i.set_data_from_numpy(arr)
            inputs.append(i)
        return client.infer(model, inputs).as_numpy("last_hidden_state")
    finally:
        client.close()


def main(model, http_url, grpc_url, req_path, out_path, err_path):
    reqs = np.load(req_path)
    n = len([k for k in reqs.files if k.startswith("ids_")])
    jobs = []
    for k in range(n):
        feeds = {"input_ids": reqs[f"ids_{k}"], "attention_mask": reqs[f"mask_{k}"]}
        jobs.append((grpcclient, grpc_url) if k % 2 == 0 else (httpclient, http_url))
        jobs[-1] = jobs[-1] + (feeds,)
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda j: infer(j[0], j[1], model, j[2]), jobs))

    ids, mask = reqs["ids_0"], reqs["mask_0"]
    bad = {
        "wrong_dtype": dict(feeds={"input_ids": ids.astype(np.float32), "attention_mask": mask},
                            dtype_override={"input_ids": "FP32"}),
        "wrong_rank": dict(feeds={"input_ids": ids[None], "attention_mask": mask[None]}),
        "too_long": dict(feeds={"input_ids": np.ones((1, int(reqs["max_len"]) + 8), np.int64),
                                "attention_mask": np.ones((1, int(reqs["max_len"]) + 8), np.int64)}),
        "oversize_batch": dict(feeds={"input_ids": np.repeat(ids[:1], int(reqs["max_batch"]) + 1, 0),
                                      "attention_mask": np.repeat(mask[:1], int(reqs["max_batch"]) + 1, 0)}),
    }
    errors = {}
    for label, b in bad.items():
        for mod, url in ((grpcclient, grpc_url), (httpclient, http_url)):
            key = f"{label}/{mod.__name__.split('.')[-1]}"
            try:
                infer(mod, url, model, b["feeds"], b.get("dtype_override"))
                errors[key] = None
            except Exception as e:  # noqa: BLE001 - the server's answer is what the test checks
                errors[key] = str(e)
    after = infer(grpcclient, grpc_url, model, {"input_ids": ids, "attention_mask": mask})
    np.savez(out_path, after=after, **{f"out_{k}": a for k, a in enumerate(answers)})
    with open(err_path, "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
