"""Log-probabilities in OpenAI's two response shapes, from the engine's per-token dicts
(`RequestOutput.logprobs`: token id -> log-probability, the top-N plus the chosen token).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`, top N by value.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
`top_logprobs` dict also holds the chosen token, as vLLM's does.
"""

from __future__ import annotations

from typing import Any


class LogprobFormatter:
    def __init__(self, tokenizer: Any, kind: str, top_n: int) -> None:
        self.tokenizer, self.kind, self.top_n = tokenizer, kind, top_n
        self.offset = 0  # completions: characters of completion text before the next token

    def _text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def format(self, token_ids: list[int], lps: list[dict[int, float]] | None) -> dict | None:
        """The logprobs object for these output tokens (one chunk, or a whole response)."""
        if lps is None:
            return None
        if self.kind == "chat":
            content = []
            for tid, d in zip(token_ids, lps):
                top = sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:self.top_n]
                content.append({**self._entry(tid, d[tid]), "top_logprobs": [self._entry(t, v) for t, v in top]})
            return {"content": content}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, d in zip(token_ids, lps):
            text = self._text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(d[tid])
            out["top_logprobs"].append({self._text(t): v for t, v in d.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _entry(self, tid: int, logprob: float) -> dict:
        text = self._text(tid)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge(parts: list[dict]) -> dict | None:
    """One response's logprobs object from its chunks' objects."""
    if not parts:
        return None
    merged: dict[str, list] = {k: [] for k in parts[0]}
    for p in parts:
        for k, v in p.items():
            merged[k] += v
    return merged
