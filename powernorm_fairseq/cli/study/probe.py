"""What a cell measures besides training: the gradient norms and loss at init, and the landscape at the end."""

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from ...common.files import atomic_path


def initial_probe(cfg, loss_key, batches=4):
    """Per-layer gradient norms of the per-example (per-token) training loss,
    and that loss in bits, of the model as freshly initialised with the cell's
    seed, in training mode without dropout, averaged over the first batches of
    the training data (Figures 2 and 3 of the sentiment study). ``cfg``: the cell's fairseq configuration,
    which the probe may change (a copy)."""
    from fairseq import tasks, utils

    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model).float()
    criterion = task.build_criterion(cfg.criterion)
    from ..landscape import training_batches

    samples = training_batches(task, model, "train", batches, cfg.dataset.max_tokens or 4096, cfg.common.seed)
    model.train()
    for m in model.modules():
        if "Dropout" in type(m).__name__:
            m.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    norms, losses = defaultdict(list), []
    for sample in samples:
        model.load_state_dict(state)  # the running statistics as at init for every batch
        model.zero_grad(set_to_none=True)
        loss, size, out = criterion(model, sample)
        loss.backward()
        if loss_key == "nll_loss":  # without label smoothing, per token
            losses.append(float(out["nll_loss"]) / out["ntokens"] / math.log(2))
        else:
            losses.append(loss.item() / size / math.log(2))
        squares = defaultdict(float)
        for name, p in model.named_parameters():
            if p.grad is not None:
                squares[layer_of(name)] += (p.grad.double() / size).pow(2).sum().item()
        for layer, sq in squares.items():
            norms[layer].append(sq ** 0.5)
    return {"loss": sum(losses) / len(losses), "batches": len(samples),
            "grad_norms": {layer: sum(v) / len(v) for layer, v in sorted(norms.items(), key=lambda kv: order(kv[0]))}}


def layer_of(name):
    m = re.match(r"(encoder|decoder)\.(?:sentence_encoder\.)?layers\.(\d+)\.", name)
    if m:
        return f"{m.group(1)} layer {int(m.group(2)) + 1}"
    return ".".join(name.split(".")[:2]).replace("classification_heads.", "head ")


def order(layer):
    """Embeddings, then the layers bottom up (encoder before decoder), then the rest (final norm, head)."""
    m = re.match(r"(encoder|decoder) layer (\d+)$", layer)
    if m:
        return (1, m.group(1) != "encoder", int(m.group(2)), layer)
    return (0 if "embed" in layer else 2, False, 0, layer)


def measure_landscape(args, cell, root, result):
    """``--landscape`` at the cell's final checkpoint, added to its result."""
    from ..landscape import landscape

    _, summary = landscape([root / "checkpoint_last.pt"], args.data, "train", 2, args.max_tokens, 8, None,
                           cell["seed"])
    result = dict(result, **dict(zip(("lipschitz", "smoothness", "grad_norm"), summary[0][5:8])))
    with atomic_path(root / "result.json") as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1))
    return result
