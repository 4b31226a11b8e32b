"""A tensor-parallel worker (rank 1..N-1): `python -m preheat.engine.distributed.worker ARGS`.

Started by rank 0 (engine/distributed/launcher.py) with its settings as one JSON argument.
It builds its shard of the model and its heads of the KV pool, then follows rank 0: for each
message, run the same forward pass (its all-reduces meet rank 0's), send or receive KV pages,
or stop. It holds no scheduler, cache, sampler or tokenizer.

It lives exactly as long as rank 0 wants it: SIGINT and SIGTERM are ignored (a terminal's
Ctrl-C or a container stop reaches rank 0, which drains, snapshots — reading KV from here —
and then stops the workers), and it exits at once when its lifeline pipe reports EOF, which
happens however rank 0 ends, SIGKILL included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

log = logging.getLogger("preheat.engine.distributed.worker")


def _watch_lifeline(fd: int) -> None:
    """Exits the process when rank 0's end of the pipe closes."""
    while True:
        try:
            data = os.read(fd, 1)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            log.info("rank 0 is gone; exiting")
            logging.shutdown()
            os._exit(0)


def _load(model: dict[str, Any], dtype: Any) -> tuple[Any, Any, Any]:
    """(hf_config, spec, tensors) of the checkpoint rank 0 loaded."""
    from preheat.engine.model.spec import ModelSpec

    if model.get("weights_dir"):
        from transformers import AutoConfig

        from preheat.engine.model.checkpoint import LazyCheckpoint

        config = AutoConfig.from_pretrained(model["weights_dir"])
        return config, ModelSpec.from_hf_config(config), LazyCheckpoint(model["weights_dir"], dtype)
    from preheat.engine.model.loader import load_model  # a GGUF with the weight cache off

    loaded = load_model(model["source"], dtype, model.get("weight_cache_dir"))
    return loaded.hf_config, loaded.spec, loaded.weights


def run(args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from preheat.engine.distributed.comm import Comm, all_reduce
    from preheat.engine.distributed.launcher import STORE_PREFIX
    from preheat.engine.distributed.messages import Op, decode_values, unpack_step
    from preheat.engine.distributed.sharding import Sharder, local_kv_heads
    from preheat.engine.dtypes import torch_dtype
    from preheat.engine.kernels.backend import select_backend
    from preheat.engine.kv.pool import KVPool
    from preheat.engine.model.build import build_model, select_moe_backend

    rank, size = int(args["rank"]), int(args["size"])
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.FileStore(str(args["store_path"]), size)  # launcher.py: never a TCP listener
    store.set_timeout(timedelta(seconds=args["timeout_s"]))
    model_args = dict(args["model"])
    if not model_args.get("weights_dir"):  # a GGUF: rank 0 converts it, then says where to
        model_args.update(json.loads(store.get(STORE_PREFIX + "weights")))
    dtype = torch_dtype(model_args["dtype"])
    hf_config, spec, tensors = _load(model_args, dtype)
    if model_args.get("quantization"):  # as rank 0: whole matrices quantized, then cut
        from preheat.engine.model.loader import default_model_path
        from preheat.engine.model.quantize import quantize_weights

        source = model_args["source"] or default_model_path()  # a GGUF's own blocks, as rank 0 reads them
        tensors = quantize_weights(tensors, spec, source, model_args["quantization"])
    moe_backend = select_moe_backend(device) if spec.moe is not None else "torch"
    # The kernel backend, chosen as rank 0 chooses it: it decides the weights' form (packed for
    # the CPU kernels) and whether rows are padded, which every rank's all-reduces must agree on.
    model = build_model(spec, hf_config, tensors, device, dtype, moe_backend, sharder=Sharder(spec, size, rank),
                        reduce=all_reduce,
                        backend=select_backend(device, model_args.get("int8_activation_bits", 16)))  # fmt: skip
    del tensors
    store.set(f"{STORE_PREFIX}loaded/{rank}", "1")
    comm = Comm.init(store, rank, size, device, float(args["timeout_s"]))
    sizing = json.loads(store.get(STORE_PREFIX + "pool"))
    heads = local_kv_heads(spec.num_kv_heads, size)
    pool = KVPool(spec.num_layers, heads, spec.head_dim, sizing["num_pages"], sizing["page_size"],
                  torch_dtype(sizing["dtype"]), device)  # fmt: skip
    store.set(f"{STORE_PREFIX}ready/{rank}", "1")
    log.info("rank %d/%d ready on %s: %d query heads, %d KV heads, %d pages", rank, size, device,
             model.layers[0].attn.num_heads, heads, pool.num_pages)  # fmt: skip
    with torch.inference_mode():
        while True:
            op, payload = comm.receive()
            if op is Op.STEP:
                input_ids, meta = unpack_step(payload, device)
                model.forward(input_ids, meta, pool)
            elif op is Op.READ_PAGES:
                (pages,) = decode_values(payload)
                comm.gather_to_rank0(pool.read_pages(pages))
            elif op is Op.WRITE_PAGES:
                (pages,) = decode_values(payload)
                like = torch.empty((spec.num_layers, 2, len(pages) * pool.page_size, heads, spec.head_dim),
                                   dtype=pool.dtype)  # fmt: skip
                pool.write_pages(pages, comm.scatter_from_rank0(None, like))
            elif op is Op.SHUTDOWN:
                break
    log.info("rank %d: stopping", rank)
    comm.close()


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    logging.basicConfig(
        level=str(args.get("log_level", "info")).upper(),
        format=f"%(asctime)s %(levelname)s [tp rank {args['rank']}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_lifeline, args=(int(args["lifeline_fd"]),), name="lifeline", daemon=True).start()
    try:
        run(args)
    except BaseException:
        log.exception("tensor-parallel worker failed")
        logging.shutdown()
        os._exit(1)  # no teardown: the group is broken and rank 0 is told by our exit
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
