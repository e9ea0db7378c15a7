"""Delta weight syncs (``pipeline.weight_sync_delta``) against full ones, and how far log-probs
drift when a sample's K/V cache is older than the weights (``rollout.max_kv_age``).

    python -m benchmarks.delta_sync            # writes results_delta_sync.md and its README section

1. Bytes and seconds per sync. A model takes real AdamW steps at the default preset's lr (1e-5) on a
   batch of arithmetic problems with their answers (the default task's kind of text); after each,
   its weights go to a receiver over the collective path (``offstep.sync.collective``: a gloo group
   of two ranks in this process, one thread each, over loopback), first as a delta from the version
   before, then whole. Seconds: from the send's start until the receiver holds the version (pack or
   encode, transfer, apply); the digest that every sync takes anyway is not included.
2. K/V age. Each sequence's first half is prefilled by the weights of version 0, its second half
   teacher-forced by those of version a (a AdamW steps later) reading that cache (``keep``), and
   compared with what version a gives with a cache of its own (``recompute``).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh
from offstep.models.loading import load_causal_lm, load_tokenizer, resolve_model
from offstep.sync.collective import WeightReceiver, WeightSender, manifest
from offstep.sync.delta import DeltaSender, fingerprint
from offstep.sync.digest import digest_of

LR = 1e-5  # offstep/config/preset/default.yaml: actor.optim.lr
OUT = RESULTS / "results_delta_sync.md"
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INT = {4: torch.int32, 2: torch.int16}


def arithmetic_batch(tok) -> torch.Tensor:
    texts = [
        f"Question: what is {a} {op} {b}? Answer: {a + b if op == '+' else a - b}"
        for a, b, op in [
            (3, 4, "+"),
            (9, 2, "-"),
            (7, 8, "+"),
            (6, 5, "-"),
            (1, 9, "+"),
            (8, 3, "-"),
            (5, 5, "+"),
            (4, 7, "-"),
        ]
    ]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    width = min(len(x) for x in ids)
    return torch.tensor([x[:width] for x in ids])


def _threads(*fns) -> None:
    errors: list[BaseException] = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def changed(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.reshape(-1).view(INT[a.element_size()]) != b.reshape(-1).view(INT[b.element_size()])).sum())


class Link:
    """A sender and a receiver of ``dtype`` weights for ``model`` over a gloo group in this process."""

    def __init__(self, model, dtype: str):
        self.model, self.dtype = model, dtype
        self.rollout = load_causal_lm_like(model, DT[dtype])
        self.receiver = WeightReceiver(self.rollout, torch.device("cpu"))
        self.sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=1800)
        host, port = self.sender.endpoint
        self.specs = manifest(self.rollout)
        _threads(
            lambda: self.sender.connect(2, "gloo", self.specs, 64 << 20, manifest(model)),
            lambda: self.receiver.connect(host, port, 1, 2, "gloo", self.specs, 64 << 20, 1800),
        )
        self.delta = DeltaSender(self.specs, full_every=1 << 30)
        self.version = 0
        self.send(delta=True)  # version 0, whole: the first base

    def send(self, delta: bool) -> float:
        held = fingerprint(digest_of(self.specs, self.rollout.get_parameter)) if delta else None
        t0 = time.perf_counter()
        _threads(
            lambda: self.sender.send(self.model.named_parameters(), self.version, self.delta if delta else None),
            lambda: self.receiver.receive(self.version, held),
        )
        return time.perf_counter() - t0

    def row(self, name: str, step: int) -> dict:
        """After an update: the elements that changed in the rollout's dtype, then the delta and the full sync."""
        self.version += 1
        n_changed = sum(
            changed(p.detach().to(DT[self.dtype]), self.rollout.get_parameter(n))
            for n, p in self.model.named_parameters()
        )
        t_delta = self.send(delta=True)
        want = digest_of(self.specs, lambda n: self.model.get_parameter(n).detach().to(DT[self.dtype]))
        assert digest_of(self.specs, self.rollout.get_parameter) == want, "the delta did not give the full weights"
        t_full = self.send(delta=False)
        numel = sum(s.numel for s in self.specs)
        return dict(
            model=name,
            dtype=self.dtype,
            step=step,
            changed=n_changed,
            numel=numel,
            full=numel * DT[self.dtype].itemsize,
            delta=self.delta.last.nbytes,
            t_full=t_full,
            t_delta=t_delta,
        )


def load_causal_lm_like(model, dtype):
    import copy

    out = copy.deepcopy(model).to(dtype)
    out.requires_grad_(False)
    return out


def smollm_rows(tok, steps: int) -> tuple[list[dict], dict]:
    """SmolLM2-135M: ``steps`` torch AdamW steps, synced after each in float32 and bfloat16; the
    weights after steps 1, 2, 4, 8 kept for the K/V-age drift."""
    model = load_causal_lm(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    ids = arithmetic_batch(tok)
    links = [Link(model, "float32"), Link(model, "bfloat16")]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    kept = {0: {n: p.detach().clone() for n, p in model.named_parameters()}}
    rows = []
    for step in range(1, max(steps, 8) + 1):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
        if step in (1, 2, 4, 8):
            kept[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if step <= steps:
            rows += [link.row("SmolLM2-135M", step) for link in links]
    del links
    return rows, {"model": model, "ids": ids, "kept": kept}


def big_rows(tok) -> list[dict]:
    """A random Llama of ~1.1B parameters (SmolLM2's vocabulary and head layout, TinyLlama's
    depth and widths): one AdamW step (the first step of AdamW moves each weight by lr times the
    sign of its gradient: written out, so no optimizer state is held), synced in bfloat16; float32's
    changed elements counted from the update itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    link = Link(model, "bfloat16")
    ids = arithmetic_batch(tok)
    model(ids, labels=ids).loss.backward()
    fp32_changed = 0
    with torch.no_grad():
        for p in model.parameters():
            old = p.detach().clone()
            p.sub_(LR * torch.sign(p.grad))
            p.grad = None
            fp32_changed += changed(p, old)
    numel = sum(p.numel() for p in model.parameters())
    rows = [link.row("random Llama 1.1B", 1)]
    rows.append(
        dict(
            model="random Llama 1.1B",
            dtype="float32",
            step=1,
            changed=fp32_changed,
            numel=numel,
            full=numel * 4,
            delta=None,
            t_full=None,
            t_delta=None,
        )
    )
    return rows


@torch.no_grad()
def drift_rows(model, ids, kept) -> list[dict]:
    """Max and mean |log-prob difference| of the second half of each sequence: K/V of its first
    half from version 0 (keep) against version a's own (recompute)."""
    from transformers import DynamicCache

    half = ids.shape[1] // 2
    out = []
    model.eval()

    def load(state):
        for n, p in model.named_parameters():
            p.copy_(state[n])

    def lp(lg):
        return torch.log_softmax(lg[:, :-1].float(), -1).gather(-1, ids[:, half + 1 :, None]).squeeze(-1)

    load(kept[0])
    start = lp(model(ids).logits[:, half:])
    for age in (1, 2, 4, 8):
        load(kept[0])
        first = model(ids[:, :half], past_key_values=DynamicCache(), use_cache=True)
        load(kept[age])
        tail = lp(model(ids[:, half:], past_key_values=first.past_key_values, use_cache=True).logits)
        whole = lp(model(ids).logits[:, half:])
        diff = (tail - whole).abs()
        out.append(
            dict(
                age=age,
                max=float(diff.max()),
                mean=float(diff.mean()),
                tokens=int(diff.numel()),
                moved=float((whole - start).abs().mean()),
            )
        )
    return out


def mb(x) -> str:
    return "–" if x is None else f"{x / 1e6:.1f}"


def write(rows: list[dict], drift: list[dict], load: tuple, threads: int) -> None:
    lines = [
        "# Delta weight syncs and K/V age",
        "",
        f"{provenance()} Load average before / after: {load[0]:.2f} / {load[1]:.2f} (1 min; 2 cores shared with "
        f"other engineers' tests and builds); torch threads: {threads}. Transfers: the collective path (gloo, "
        "loopback, one process, a thread per rank); seconds from the send's start until the receiver holds the "
        "version, without the digest every sync takes anyway. Updates: AdamW at lr 1e-5 (the default preset's) on "
        "a batch of 8 arithmetic problems with their answers.",
        "",
        "| model | rollout dtype | after step | elements changed | full MB | delta MB | delta / full | full s | delta s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ts(t: float | None) -> str:
        return "–" if t is None else f"{t:.2f}"

    for r in rows:
        ratio = "–" if r["delta"] is None else f"{r['delta'] / r['full']:.3f}"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['step']} | {100 * r['changed'] / r['numel']:.2f}% | "
            f"{mb(r['full'])} | {mb(r['delta'])} | {ratio} | {ts(r['t_full'])} | {ts(r['t_delta'])} |"
        )
    lines += [
        "",
        "Float32 weights: nearly every element moves at every step (AdamW's step is lr-sized on every weight with a "
        "gradient), so a delta is the whole tensor and buys nothing. Bfloat16 weights round most lr-sized moves away. "
        "The random 1.1B model's float32 row is counted from the update (not sent: four float32 copies of it do not "
        "fit beside the other work in this machine's 24 GiB).",
        "",
        "## K/V age: log-probs when a sample's cache is older than the weights",
        "",
        "SmolLM2-135M-Instruct, float32, the same 8 sequences: the first half's K/V from version 0, the second half "
        "teacher-forced by version a over that cache, against version a's own forward (what `recompute` gives).",
        "",
        "| K/V age (versions) | keep against recompute: max abs log-prob difference | mean abs | the policy's own move since version 0: mean abs | keep's error / the move | tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {d['age']} | {d['max']:.2e} | {d['mean']:.2e} | {d['moved']:.2e} | {d['mean'] / d['moved']:.2f} | "
        f"{d['tokens']} |"
        for d in drift
    ]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-big", action="store_true", help="skip the random 1.1B model")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    rows, kept = smollm_rows(tok, args.steps)
    drift = drift_rows(kept["model"], kept["ids"], kept["kept"])
    del kept
    if not args.no_big:
        rows += big_rows(tok)
    write(rows, drift, (load0, os.getloadavg()[0]), torch.get_num_threads())
    print(OUT.read_text())
    refresh("delta-sync", OUT)


if __name__ == "__main__":
    main()
