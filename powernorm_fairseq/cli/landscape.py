"""The loss landscape around a checkpoint (``powernorm-analyze --landscape``,
and each cell of ``norm-study.sh --landscape``): on a few training batches,
the loss and its gradient at the weights and along the gradient's direction.
The method is described in :mod:`.analyze`'s docstring."""

from collections import defaultdict

import torch

from .checkpoint_info import AnalyzeError, checkpoint_info, checkpoint_label, load_checkpoint


def training_batches(task, model, subset, count, max_tokens, seed):
    from fairseq import utils

    task.load_dataset(subset)
    itr = task.get_batch_iterator(
        dataset=task.dataset(subset), max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=seed,
    ).next_epoch_itr(shuffle=False)
    batches = [b for _, b in zip(range(count), itr)]
    if not batches:
        raise AnalyzeError(f"the {subset} subset has no batches")
    return batches


class Probe:
    """Per-token training loss and its gradient at chosen weights, restoring every buffer after."""

    def __init__(self, model, criterion):
        self.model, self.criterion = model, criterion
        model.train()
        for m in model.modules():  # dropout off, norms keep their batch statistics
            if "Dropout" in type(m).__name__:
                m.eval()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.state = {k: v.clone() for k, v in model.state_dict().items()}

    def __call__(self, sample, direction=None, step=0.0):
        """L(W - step * direction) and its gradient (flat)."""
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(self.state[k])
            if direction is not None:
                offset = 0
                for p in self.params:
                    p.sub_(step * direction[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.model.zero_grad(set_to_none=True)
        loss, sample_size, _ = self.criterion(self.model, sample)
        # back-propagate the summed loss and divide after, as fairseq's trainer
        # does: PN's nu is kept in the units of the back-propagated gradient
        loss.backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                          for p in self.params]) / sample_size
        loss = loss / sample_size
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(self.state[k])
        return loss.item(), grad


def landscape(paths, data, subset, batches, max_tokens, steps, lr, seed):
    from fairseq import checkpoint_utils

    from ..models import PowerNormTransformerModel  # noqa: F401 (registers the models the checkpoints name)

    rows, summary = [], []
    for path in paths:
        state = load_checkpoint(path)
        kind, update = checkpoint_info(state)
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(path)], arg_overrides={"data": str(data), "norm_diagnostics": False})
        model = models[0].float()
        criterion = task.build_criterion(cfg.criterion)
        rate = lr if lr is not None else float(cfg.optimization.lr[0])
        samples = training_batches(task, model, subset, batches, max_tokens, seed)
        torch.manual_seed(seed)
        fresh = Probe(task.build_model(cfg.model).float(), criterion)
        probe = Probe(model, criterion)
        maxima = []
        for b, sample in enumerate(samples):
            loss0, grad0 = probe(sample)
            changes = []
            for k in range(1, steps + 1):
                a = rate * k / (steps + 1)  # step sizes inside (0, lr)
                loss, grad = probe(sample, grad0, a)
                changes.append((abs(loss0 - loss), (grad0 - grad).norm().item()))
                rows.append((checkpoint_label(path), kind, update, b, a, loss, *changes[-1]))
            maxima.append((max(c[0] for c in changes), max(c[1] for c in changes), grad0.norm().item(),
                           fresh(sample)[1].norm().item()))
        means = [sum(col) / len(col) for col in zip(*maxima)]
        summary.append((checkpoint_label(path), kind, update, rate, len(samples), *means))
    return rows, summary


def plot_landscape(rows, summary, plt):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    curves = defaultdict(lambda: defaultdict(list))
    for ckpt, kind, update, _, a, _, loss_change, grad_change in rows:
        curves[(kind, ckpt, update)][a].append((loss_change, grad_change))
    for (kind, ckpt, update), points in curves.items():
        steps = sorted(points)
        for ax, i in ((axes[0], 0), (axes[1], 1)):
            ax.plot(steps, [sum(p[i] for p in points[a]) / len(points[a]) for a in steps], marker="o",
                    label=f"{kind}: {ckpt} (update {update})")
    axes[0].set_ylabel(r"$|L(W) - L(W - a\,g)|$ (nats per token)")
    axes[0].set_title("Loss change along the gradient (max = Lipschitz)")
    axes[1].set_ylabel(r"$\|\nabla L(W) - \nabla L(W - a\,g)\|_2$ (nats per token per weight unit)")
    axes[1].set_title("Gradient change along the gradient (max = smoothness)")
    for ax in axes[:2]:
        ax.set_xlabel("step size a (weight units per gradient unit)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="encoder norm: checkpoint", title_fontsize=7)
    names = [f"{kind}\n{ckpt}" for ckpt, kind, *_ in summary]
    x = range(len(summary))
    axes[2].bar([i - 0.2 for i in x], [s[-1] for s in summary], width=0.4, label="step 0 (fresh init)")
    axes[2].bar([i + 0.2 for i in x], [s[-2] for s in summary], width=0.4, label="checkpoint")
    axes[2].set_xticks(list(x), names, fontsize=7)
    axes[2].set_ylabel(r"$\|\nabla L\|_2$ (nats per token per weight unit)")
    axes[2].set_title("Gradient norm at initialization and at the checkpoint")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
