"""Token blocks for QAD: text from a file / datasets name, or text the teacher generates.

Documents are tokenized (chat rows through the chat template), split into train / held-out
at the DOCUMENT level (held-out = the last `eval_fraction` of documents), and each split is
packed into fixed [seq_len] blocks (documents joined with EOS, the tail dropped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qfd.errors import QfdError

TEXT_FIELDS = ("text", "content", "document")


def _row_to_doc(row: Any, tokenizer) -> list[int] | None:
    """Token ids of one data row: text, chat messages, prompt/response pairs, GSM8K
    question/answer, or qfd data records (prompt_ids/response_ids)."""
    if isinstance(row, str):
        return tokenizer(row)["input_ids"] if row.strip() else None
    if not isinstance(row, dict):
        return None
    if "prompt_ids" in row and "response_ids" in row:
        return [int(t) for t in row["prompt_ids"]] + [int(t) for t in row["response_ids"]]
    messages = row.get("messages") or row.get("conversations")
    if messages is None:
        pairs = (("question", "answer"), ("prompt", "response"), ("prompt", "completion"), ("instruction", "output"))
        for user, assistant in pairs:
            if isinstance(row.get(user), str) and isinstance(row.get(assistant), str):
                messages = [{"role": "user", "content": row[user]}, {"role": "assistant", "content": row[assistant]}]
                break
    if messages is not None:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
            return [int(t) for t in ids]
        return tokenizer("\n".join(m.get("content", "") for m in messages))["input_ids"]
    for name in TEXT_FIELDS:
        if isinstance(row.get(name), str) and row[name].strip():
            return tokenizer(row[name])["input_ids"]
    return None


def load_documents(source: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Tokenized documents of a .txt (one per line) / .jsonl / .json file or a datasets name."""
    path = Path(str(source)).expanduser()
    if path.is_file():
        if path.suffix == ".txt":
            rows: list[Any] = [line for line in path.read_text().splitlines() if line.strip()]
        elif path.suffix == ".json":
            rows = json.loads(path.read_text())
        else:
            rows = []
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise QfdError(f"{path}:{number} is not valid JSON; give JSONL (one object per line) or a .txt file") from None
    elif path.exists():
        raise QfdError(f"--data {path} is a directory; give a .jsonl/.json/.txt file or a datasets name")
    elif str(source).startswith((".", "/", "~")) or path.suffix:
        raise QfdError(f"--data file {path} does not exist")
    else:
        try:
            import datasets

            rows = list(datasets.load_dataset(str(source), split="train"))
        except Exception as exc:  # offline / unknown name: one user-facing line
            raise QfdError(f"--data '{source}' is not a file and could not be loaded with datasets ({type(exc).__name__}); pass a local JSONL/text file") from None
    if limit is not None:
        rows = rows[:limit]
    docs = [d for d in (_row_to_doc(row, tokenizer) for row in rows) if d]
    if not docs:
        raise QfdError(f"--data {source}: no usable text found (expected text/messages/question+answer/prompt+response fields)")
    return docs


def pack_blocks(docs: list[list[int]], seq_len: int, eos_id: int | None) -> torch.Tensor:
    """[n_blocks, seq_len] int64 of the documents joined with EOS; the tail is dropped."""
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc)
        if eos_id is not None and (not doc or doc[-1] != eos_id):
            stream.append(eos_id)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def split_blocks(docs: list[list[int]], seq_len: int, eos_id: int | None, eval_fraction: float = 0.1, max_eval_blocks: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(train [N, T], held-out [M, T]): held-out = the last documents, at least one block of them."""
    n_eval_docs = max(1, int(len(docs) * eval_fraction))
    while n_eval_docs < len(docs) and pack_blocks(docs[-n_eval_docs:], seq_len, eos_id).shape[0] < 1:
        n_eval_docs += 1
    eval_blocks = pack_blocks(docs[-n_eval_docs:], seq_len, eos_id)[:max_eval_blocks]
    train_blocks = pack_blocks(docs[:-n_eval_docs], seq_len, eos_id)
    return train_blocks, eval_blocks
