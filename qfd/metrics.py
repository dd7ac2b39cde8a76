"""Server metrics in the Prometheus text exposition format (version 0.0.4), no dependencies.

Counters and histograms keyed by label tuples, thread-safe; `render()` gives the /metrics body.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TAU_BUCKETS = tuple(float(x) for x in range(1, 17))


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped)) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x)) if abs(x) < 1e15 else repr(float(x))


class Counter:
    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self.values: dict[tuple, float] = {}
        self.lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self.lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self.lock:
            items = sorted(self.values.items()) or ([((), 0.0)] if not self.label_names else [])
        lines += [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]
        return lines


class Gauge(Counter):
    def set(self, value: float, *labels: str) -> None:
        with self.lock:
            self.values[labels] = value

    def render(self) -> list[str]:
        lines = super().render()
        lines[1] = f"# TYPE {self.name} gauge"
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        if value != value:  # NaN: nothing to record
            return
        with self.lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self.lock:
            for bound, c in zip(self.buckets, self.counts):
                lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {c}')
            lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
            lines.append(f"{self.name}_sum {_num(self.sum)}")
            lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    """What `qfd serve` exposes on /metrics."""

    def __init__(self):
        self.requests = Counter("qfd_requests_total", "HTTP requests by endpoint and status code.", ("endpoint", "code"))
        self.cancelled = Counter("qfd_requests_cancelled_total", "Generations cancelled because the client disconnected.")
        self.prompt_tokens = Counter("qfd_prompt_tokens_total", "Prompt tokens prefilled.")
        self.generated_tokens = Counter("qfd_generation_tokens_total", "Tokens generated.")
        self.steps = Counter("qfd_verify_steps_total", "Target verify steps (tau = committed tokens / steps).")
        self.committed = Counter("qfd_committed_tokens_total", "Tokens committed by verify steps, bonus included.")
        self.queue = Gauge("qfd_queue_depth", "Requests waiting for the engine.")
        self.running = Gauge("qfd_requests_running", "Requests being generated (0 or 1).")
        self.latency = Histogram("qfd_request_latency_seconds", "End-to-end generation latency per request.")
        self.queue_wait = Histogram("qfd_queue_wait_seconds", "Time a request waited for the engine.")
        self.ttft = Histogram("qfd_time_to_first_token_seconds", "Prefill + first token per request.")
        self.tau = Histogram("qfd_tau", "Mean acceptance length (committed tokens per verify step) per request.", TAU_BUCKETS)

    def record_generation(self, stats, queue_wait_s: float) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.steps.inc(stats.steps)
        if stats.steps:
            self.committed.inc(stats.tau * stats.steps)
            self.tau.observe(stats.tau)
        self.latency.observe(stats.total_s)
        self.ttft.observe(stats.ttft_s)
        self.queue_wait.observe(queue_wait_s)

    def render(self) -> str:
        parts = [self.requests, self.cancelled, self.prompt_tokens, self.generated_tokens, self.steps, self.committed, self.queue, self.running, self.latency, self.queue_wait, self.ttft, self.tau]
        return "\n".join(line for metric in parts for line in metric.render()) + "\n"
