"""Model cards for the drafters we train: data, training, measured acceptance."""

from __future__ import annotations


def model_card(card: dict) -> str:
    """Markdown model card from the ``card.json`` contents ``tandem train`` writes."""
    kind = card["kind"]
    data, tr = card["data"], card["training"]
    lines = [
        f"# Tandem {kind} drafter for {data['target'].get('path')}",
        "",
        f"- **Target**: `{data['target'].get('path')}` (sha256 `{data['target'].get('sha256', '')[:16]}…`), frozen.",
        f"- **Data**: self-distillation: {data['answers']} answers ({data['answer_tokens']} answer tokens) the target "
        f"generated greedily with its chat template for prompts of "
        f"{', '.join(f'`{f}`' for f in data['settings'].get('prompts_files') or [data['settings'].get('prompts_file', '?')])} "
        f"(max {data['settings'].get('max_tokens')} tokens each); Spec-Bench and MT-Bench prompts excluded.",
        f"- **Training**: "
        + (f"fine-tuned from `{tr['init_from']}` (sha256 `{tr.get('init_from_sha256', '')[:16]}…`), "
           if tr.get("init_from") else "")
        + f"{tr['steps']} steps"
        + (f" of {tr['planned_steps']} (stopped early by SIGTERM; the same command resumes)"
           if tr.get("planned_steps", 0) > tr["steps"] else "")
        + f", {tr['wall_s']:.0f} s wall, AdamW lr {tr['lr']} (warm-up "
        f"{tr['warmup_frac']:.0%}, cosine decay), {tr['max_batch_tokens']} padded tokens per batch, seed {tr['seed']}"
        + (f", the first {tr['max_answer_tokens']} tokens of each answer" if tr.get("max_answer_tokens") else "")
        + "; "
        f"loss {tr['first_loss']:.3f} -> {tr['final_loss']:.3f}"
        + (f" (cross-entropy, {tr['soft_label_weight']:g} of it against the target's soft labels)."
           if tr.get("soft_label_weight") else "."),
    ]
    if tr.get("metrics"):
        lines.append("- **Training metrics (last 10% of steps)**: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in tr["metrics"].items()) + ".")
    val = tr.get("validation") or {}
    if val:
        unseen = ("held out of this run; the start head may have trained on some" if tr.get("init_from")
                  else "never trained on")
        lines.append(f"- **Held out** ({val['sequences']} answers, {unseen}): best step {val['best_step']} "
                     f"(its weights are the ones saved), loss {val['loss']:.3f}"
                     + "".join(f", {k} {v:.3f}" for k, v in val.get("metrics", {}).items()) + ".")
    if card.get("extra"):
        lines.append(f"- **Shape**: `{card['extra']}`.")
    lines.append(f"- **Command** (as it ran; the paths are the training machine's): `{card['command']}`")
    lines += [f"- {note}" for note in card.get("notes", [])]  # added by hand after training (provenance)
    sb = card.get("spec_bench")
    if sb:
        o = sb["overall"]
        lines += ["", f"## Measured acceptance (Spec-Bench, {sb['prompts']} prompts, greedy, max {sb['max_tokens']} "
                      f"new tokens, k = {sb['num_draft_tokens']})", "",
                  *([sb["method"], ""] if sb.get("method") else []),
                  "| category | acceptance rate | mean accepted length |", "|---|---:|---:|"]
        for cat, st in sb["per_category"].items():
            lines.append(f"| {cat} | {st['acceptance_rate']:.3f} | {st['mean_accepted_length']:.2f} |")
        lines.append(f"| **overall** | **{o['acceptance_rate']:.3f}** | **{o['mean_accepted_length']:.2f}** |")
    else:
        lines += ["", "Acceptance not measured at training time (see docs/benchmarks.md)."]
    return "\n".join(lines) + "\n"
