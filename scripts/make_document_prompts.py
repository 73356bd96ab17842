"""Document-task training prompts for self-distillation, built only from the training set.

Spec-Bench's summarization, rag, translation and extraction prompts carry long documents; the
training prompts (data/train_prompts.jsonl.gz) are short (median 122 characters) and rarely ask to
work on a given text, which is where a SpecFormer head trained on them is weakest. This writes prompts that wrap a document in such a task: the documents are the target's own
distilled answers (decoded) and the longest user prompts, never benchmark text. The target then
answers them (`tandem distill-data --prompts OUT`), and the head learns from those answers. The
shipped head's data holds 4,476 such answers; they moved summarization and rag little, less than
the extra training steps did (docs/benchmarks.md, "What changed the figures", 8294cb4).

    python scripts/make_document_prompts.py [--count 8000] [--seed 0] [--data DIR] [--out FILE]

Deterministic for a seed; each line is {"id", "source", "prompt"} like data/train_prompts.jsonl.gz (uncompressed).
"""
import argparse
import json
import random
from pathlib import Path

TASKS = [
    ("summarize", "Summarize the following text in a few sentences.\n\n{doc}"),
    ("summarize-short", "Write a one-paragraph summary of this text:\n\n{doc}"),
    ("key-points", "List the key points of the text below as bullet points.\n\nText:\n{doc}"),
    ("extract", "Extract every name, number and date mentioned in the following text.\n\n{doc}"),
    ("qa", "Read the passage and answer the question.\n\nPassage:\n{doc}\n\nQuestion: What is the main idea "
           "of the passage?"),
    ("qa-facts", "Using only the document below, answer: which facts does it state?\n\nDocument:\n{doc}"),
    ("rewrite", "Rewrite the following text in simpler words, keeping its meaning.\n\n{doc}"),
    ("translate", "Translate the following text into French.\n\n{doc}"),
    ("translate-de", "Translate the following text into German.\n\n{doc}"),
    ("title", "Give the following text a title, then explain your choice.\n\n{doc}"),
    ("summarize-terse", "Summarize: {doc}"),
    ("passage-question", "{doc}\n{question}"),
]
# questions about the document itself, for the passage-then-question form (retrieval-augmented answering)
QUESTIONS = ["What is this text about?", "Who or what does the text mention first?", "What does the text recommend?",
             "Which example does the text give?", "What is the most important point made above?",
             "What problem does the text address, and how?", "What happens at the end of the text?",
             "Which steps does the text describe?"]


def main() -> None:
    top = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=str(top / "data/distill/smollm2-135m-instruct"))
    ap.add_argument("--prompts", default=str(top / "data/train_prompts.jsonl.gz"))
    ap.add_argument("--out", default="document_prompts.jsonl")
    ap.add_argument("--min-doc-tokens", type=int, default=80)
    ap.add_argument("--max-doc-tokens", type=int, default=450)
    a = ap.parse_args()
    if a.count < 1:
        ap.error("--count must be >= 1")
    if not 1 <= a.min_doc_tokens <= a.max_doc_tokens:
        ap.error(f"need 1 <= --min-doc-tokens <= --max-doc-tokens, got {a.min_doc_tokens} and {a.max_doc_tokens}")
    existed = Path(a.out).exists()
    try:  # before the slow loading: a bad --out fails at once (append mode: nothing is truncated yet)
        open(a.out, "a", encoding="utf-8").close()
    except OSError as exc:
        ap.error(f"cannot write --out {a.out!r}: {exc.strerror or exc}")

    def fail(msg: str) -> None:
        if not existed:
            Path(a.out).unlink(missing_ok=True)
        ap.error(msg)

    from tandem.data import load_prompts
    from tandem.errors import InvalidRequestError
    from tandem.models.weights import load_checkpoint
    from tandem.tokenizer import load_tokenizer
    from tandem.train.distill import read_distilled

    tok = load_tokenizer(load_checkpoint(None))
    try:
        manifest, seqs = read_distilled(a.data)
        prompts = load_prompts(a.prompts)
    except InvalidRequestError as exc:
        fail(str(exc))
    rng = random.Random(a.seed)
    docs = []  # (source id, text)
    for rec, seq in zip(manifest.records, seqs):
        if rec.prompt_id.startswith("doc"):  # answers to earlier document prompts are not documents
            continue
        if rec.finish_reason == "stop" and a.min_doc_tokens <= rec.answer_len <= a.max_doc_tokens:
            docs.append((rec.prompt_id, tok.decode(seq.tokens[seq.prompt_len:].tolist()).strip()))
    for rec in prompts:
        if 600 <= len(rec.text) <= 4500:
            docs.append((rec.prompt_id, rec.text.strip()))
    if not docs:
        fail(f"no documents between {a.min_doc_tokens} and {a.max_doc_tokens} tokens in {a.data}")
    rng.shuffle(docs)
    with open(a.out, "w", encoding="utf-8") as f:
        for i in range(a.count):
            src, doc = docs[i % len(docs)]
            name, template = TASKS[i % len(TASKS)]
            prompt = template.format(doc=doc, question=QUESTIONS[(i // len(TASKS)) % len(QUESTIONS)])
            f.write(json.dumps({"id": f"doc{i}-{name}/{src}", "source": f"document-task:{name}",
                                "prompt": prompt}) + "\n")
    print(f"{a.count} prompts from {len(docs)} documents -> {a.out}")


if __name__ == "__main__":
    main()
