#!/usr/bin/env python3
"""What KEDA would see: evaluates a ScaledObject's Prometheus queries on scraped /metrics text.

KEDA's prometheus scaler sends each trigger's `query` to Prometheus and uses
the single sample it returns; the HPA it drives then turns that value into a
replica count. This script does the same offline, from the Prometheus text
exposition of the workers (scraped over HTTP or saved to files), so the
ScaledObject in k8s/components/keda can be checked against the metrics Prism
really exports, without Prometheus or KEDA:

    # every trigger of the ScaledObject, against two live workers
    scripts/keda_query.py --target http://10.0.0.5:8082/metrics pod=prism-worker-spot-0 \\
                          --target http://10.0.0.6:8082/metrics pod=prism-worker-spot-1

    # one query against saved scrapes
    scripts/keda_query.py --query 'sum(vllm:num_requests_waiting{namespace="prism"})' \\
                          --target worker0.prom --target worker1.prom

Prometheus attaches target labels to every scraped series; `--target SRC
[k=v ...]` does the same (default: namespace=<--namespace>, pod=target-N,
job=<--namespace>/prism-worker).

Supported PromQL: instant vector selectors with =, !=, =~, !~ matchers;
sum/avg/min/max/count with `by (...)` / `without (...)`; number literals;
+ - * / between an aggregated vector and a number. That covers the queries
that vLLM autoscaling guides put in ScaledObjects.

KEDA's rules, as in its prometheus scaler: an empty result is 0 (the
default ignoreNullValues=true), more than one sample is an error, the
value is the first sample's. HPA: AverageValue -> ceil(value / threshold)
replicas; Value -> ceil(current * value / threshold), either unchanged
within the HPA's 10% tolerance; the largest trigger
wins, bounded by min/maxReplicaCount; with minReplicaCount 0 and no trigger
above its activationThreshold, 0.

Exit status: 0, 1 on a query error (KEDA would report the scaler as failing),
2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

Labels = dict[str, str]
Sample = tuple[Labels, float]  # labels include __name__


class QueryError(Exception):
    """The query failed: KEDA would report the scaler as erroring."""


# ---------------------------------------------------------------- exposition format

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return value.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")


def _float(text: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(text) or float(text)


def parse_exposition(text: str, target_labels: Labels) -> list[Sample]:
    """Parses Prometheus text format 0.0.4 / OpenMetrics samples (comments skipped)."""
    samples: list[Sample] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"line {lineno}: not a sample: {line[:80]!r}")
        labels: Labels = dict(target_labels)
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                raise ValueError(f"line {lineno}: bad labels: {body[:80]!r}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        labels["__name__"] = m.group(1)
        samples.append((labels, _float(m.group(4))))
    return samples


# ---------------------------------------------------------------- PromQL subset

_TOKEN = re.compile(r'\s*(?:(?P<num>[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)|(?P<str>"(?:[^"\\]|\\.)*")'
                    r'|(?P<op>=~|!~|!=|=|[{}(),+\-*/])|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*))')
AGGREGATIONS = {"sum", "avg", "min", "max", "count"}


@dataclass
class Selector:
    name: str | None
    matchers: list[tuple[str, str, str]] = field(default_factory=list)

    def matches(self, labels: Labels) -> bool:
        if self.name is not None and labels.get("__name__") != self.name:
            return False
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            ok = {"=": have == value, "!=": have != value,
                  "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
            if not ok:
                return False
        return True


class Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise QueryError(f"unexpected character at {pos}: {text[pos:pos + 20]!r}")
            kind = m.lastgroup or ""
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise QueryError(f"expected {value or 'more'}, got {tok[1] if tok else 'end of query'}")
        self.i += 1
        return tok

    def parse(self):
        node = self.expr()
        if self.peek() is not None:
            raise QueryError(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self):
        node = self.term()
        while self.peek() and self.peek()[1] in "+-":
            op = self.take()[1]
            node = ("binop", op, node, self.term())
        return node

    def term(self):
        node = self.atom()
        while self.peek() and self.peek()[1] in "*/":
            op = self.take()[1]
            node = ("binop", op, node, self.atom())
        return node

    def labels_list(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() and self.peek()[1] != ")":
            names.append(self.take()[1])
            if self.peek() and self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return names

    def atom(self):
        kind, value = self.take()
        if kind == "num":
            return ("num", float(value))
        if value == "(":
            node = self.expr()
            self.take(")")
            return node
        if kind == "id" and value in AGGREGATIONS and self.peek() and self.peek()[1] in ("(", "by", "without"):
            grouping = ("by", [])
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take()[1], self.labels_list())
            self.take("(")
            inner = self.expr()
            self.take(")")
            if self.peek() and self.peek()[1] in ("by", "without"):
                grouping = (self.take()[1], self.labels_list())
            return ("agg", value, grouping, inner)
        if kind == "id" or value == "{":
            sel = Selector(None if value == "{" else value)
            if value == "{" or (self.peek() and self.peek()[1] == "{"):
                if value != "{":
                    self.take("{")
                while self.peek() and self.peek()[1] != "}":
                    label = self.take()[1]
                    op = self.take()[1]
                    skind, sval = self.take()
                    if skind != "str" or op not in ("=", "!=", "=~", "!~"):
                        raise QueryError(f"bad matcher {label}{op}{sval}")
                    sel.matchers.append((label, op, _unescape(sval[1:-1])))
                    if self.peek() and self.peek()[1] == ",":
                        self.take(",")
                self.take("}")
            if sel.name is None:
                names = [v for (l, o, v) in sel.matchers if l == "__name__" and o == "="]
                sel.name = names[0] if names else None
            return ("sel", sel)
        raise QueryError(f"unsupported PromQL near {value!r} (see --help for the subset)")


def _drop_name(labels: Labels) -> Labels:
    return {k: v for k, v in labels.items() if k != "__name__"}


def evaluate(node, samples: list[Sample]):
    """Returns a float (scalar) or a list of (labels, value) (instant vector)."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sel":
        return [(dict(l), v) for l, v in samples if node[1].matches(l)]
    if kind == "agg":
        _, op, (mode, names), inner = node
        vec = evaluate(inner, samples)
        if not isinstance(vec, list):
            raise QueryError(f"{op}() needs a vector")
        groups: dict[tuple, tuple[Labels, list[float]]] = {}
        for labels, value in vec:
            labels = _drop_name(labels)
            key_labels = ({k: labels[k] for k in names if k in labels} if mode == "by"
                          else {k: v for k, v in labels.items() if k not in names})
            key = tuple(sorted(key_labels.items()))
            groups.setdefault(key, (key_labels, []))[1].append(value)
        fn = {"sum": sum, "avg": lambda xs: sum(xs) / len(xs), "min": min, "max": max, "count": len}[op]
        return [(labels, float(fn(values))) for labels, values in groups.values()]
    if kind == "binop":
        _, op, left, right = node
        lv, rv = evaluate(left, samples), evaluate(right, samples)
        apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
                 "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}[op]
        if isinstance(lv, list) and isinstance(rv, list):
            raise QueryError("vector-vector arithmetic is not supported")
        if isinstance(lv, list):
            return [(_drop_name(l), apply(v, rv)) for l, v in lv]
        if isinstance(rv, list):
            return [(_drop_name(l), apply(lv, v)) for l, v in rv]
        return apply(lv, rv)
    raise QueryError(f"bad node {kind}")


def keda_value(query: str, samples: list[Sample]) -> float:
    """The number KEDA's prometheus scaler reads for `query`."""
    result = evaluate(Parser(query).parse(), samples)
    if not isinstance(result, list):
        return float(result)
    if not result:
        return 0.0  # ignoreNullValues: true (KEDA's default)
    if len(result) > 1:
        raise QueryError(f"prometheus query returns {len(result)} elements, KEDA needs exactly one: "
                         + ", ".join(str(l) for l, _ in result[:4]))
    value = result[0][1]
    if math.isnan(value) or math.isinf(value):
        raise QueryError(f"query value is {value}")
    return value


# ---------------------------------------------------------------- ScaledObject + HPA


HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default


def desired_replicas(metric_type: str, value: float, threshold: float, current: int) -> int:
    """The HPA's formula for one external metric (with its 10% tolerance band)."""
    if metric_type == "Value":
        ratio = value / threshold
        if current > 0 and abs(1.0 - ratio) <= HPA_TOLERANCE:
            return current
        return math.ceil(current * ratio)
    # AverageValue (KEDA's default): the value is shared by the current pods.
    if current > 0 and abs(1.0 - value / (threshold * current)) <= HPA_TOLERANCE:
        return current
    return math.ceil(value / threshold)


def load_scaledobject(path: Path) -> dict:
    try:
        import yaml
    except ImportError:
        sys.exit("keda_query.py: reading a ScaledObject needs PyYAML (pip install pyyaml), or pass --query")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ScaledObject"]
    if len(docs) != 1:
        sys.exit(f"keda_query.py: {path} holds {len(docs)} ScaledObjects, want 1")
    return docs[0]


def read_source(src: str) -> str:
    if src.startswith(("http://", "https://")):
        with urllib.request.urlopen(src, timeout=10) as resp:  # noqa: S310 - operator-given URL
            return resp.read().decode("utf-8")
    return Path(src).read_text()


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", nargs="+", action="append", metavar=("SRC", "LABEL=VALUE"), required=True,
                    help="a /metrics URL or a file, then labels Prometheus would attach")
    ap.add_argument("--scaledobject", type=Path, default=here.parent / "k8s/components/keda/scaledobject.yaml")
    ap.add_argument("--query", help="evaluate this query instead of the ScaledObject's triggers")
    ap.add_argument("--namespace", default="prism", help="namespace label added to every target (default prism)")
    ap.add_argument("--current-replicas", type=int, help="pods of the scale target now (default: number of targets)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    opts = ap.parse_args(argv)

    samples: list[Sample] = []
    for n, (src, *pairs) in enumerate(opts.target):
        labels = {"namespace": opts.namespace, "pod": f"target-{n}", "job": f"{opts.namespace}/prism-worker"}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                ap.error(f"target label {pair!r} is not LABEL=VALUE")
            labels[key] = value
        try:
            samples += parse_exposition(read_source(src), labels)
        except (OSError, ValueError) as err:
            print(f"keda_query.py: {src}: {err}", file=sys.stderr)
            return 2
    current = opts.current_replicas if opts.current_replicas is not None else len(opts.target)

    if opts.query:
        triggers = [{"name": "query", "metricType": "AverageValue", "metadata": {"query": opts.query}}]
        so = {"spec": {}}
    else:
        so = load_scaledobject(opts.scaledobject)
        triggers = [t for t in so["spec"]["triggers"] if t["type"] == "prometheus"]

    out = {"current_replicas": current, "triggers": []}
    failed = False
    for t in triggers:
        meta = t["metadata"]
        entry = {"name": t.get("name"), "query": meta["query"], "metric_type": t.get("metricType", "AverageValue")}
        try:
            entry["value"] = keda_value(meta["query"], samples)
        except QueryError as err:
            entry["error"] = str(err)
            failed = True
        if "threshold" in meta and "value" in entry:
            threshold = float(meta["threshold"])
            entry["threshold"] = threshold
            entry["active"] = entry["value"] > float(meta.get("activationThreshold", 0))
            entry["desired_replicas"] = desired_replicas(entry["metric_type"], entry["value"], threshold, current)
        out["triggers"].append(entry)
    spec = so["spec"]
    if not opts.query and not failed:
        lo, hi = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
        wanted = max(t["desired_replicas"] for t in out["triggers"])
        if lo == 0 and not any(t["active"] for t in out["triggers"]):
            wanted = 0
        out["desired_replicas"] = min(hi, max(lo, wanted))

    if opts.json:
        print(json.dumps(out, indent=2))
    else:
        for t in out["triggers"]:
            if "error" in t:
                print(f"{t['name']}: {t['query']}\n  ERROR {t['error']}")
                continue
            line = f"{t['name']}: {t['query']}\n  value {t['value']:g}"
            if "threshold" in t:
                line += (f" (threshold {t['threshold']:g}, {t['metric_type']}, "
                         f"{'active' if t['active'] else 'inactive'}) -> {t['desired_replicas']} replicas")
            print(line)
        if "desired_replicas" in out:
            print(f"desired replicas: {out['desired_replicas']} (now {current})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
