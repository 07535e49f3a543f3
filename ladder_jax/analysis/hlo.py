"""The one reader of compiled HLO text: a scheduled module as computations of typed instructions
(`Op`: operands, attributes, shape, replica group, the model layer that made it, whether it is
a matmul kernel). docs/analysis.md, 'See the overlap'.

    module = Module(text); [(op.opcode, op.layer, module.collective(op)) for op in module.entry]"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")
SCOPE = re.compile(r"layer(\d+)\.(attn|mlp|parallel)")
SMALL_M_MATMUL = "small_m_matmul"  # `ladder_jax.model.matvec.KERNEL_NAME`
_SMALL_M = re.compile(r'name = \\?"' + SMALL_M_MATMUL + r'\\?"')  # the Triton call's name
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)


class HloError(ValueError):
    pass


def nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        bits = (
            8
            if dtype == "pred"
            else 16
            if dtype == "bf16"
            else int(re.match(r"[a-z]+?(\d+)", dtype).group(1))
        )
        size = max(1, bits // 8)
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * size
    return total


_KERNEL_STRATEGY = re.compile(r'"kernel_strategy":"KERNEL_STRATEGY_TRITON_(ONE_SHOT|TWO_SHOT)"')


@dataclasses.dataclass
class Op:
    name: str
    shape: str
    opcode: str
    text: str

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.text)
        return m.group(1) if m else ""

    @property
    def layer(self) -> int | None:
        m = SCOPE.search(self.op_name)
        return int(m.group(1)) if m else None

    @property
    def arguments(self) -> str:
        """The text after `opcode(`: the operands, then `)` and the attributes."""
        after_shape = _HEAD.match(self.text).end() + len(self.shape)
        start = self.text.index(self.opcode + "(", after_shape) + len(self.opcode) + 1
        return self.text[start:]

    @functools.cached_property
    def operands(self) -> list[str]:
        """Operand names, in order (the text between the opcode's parentheses)."""
        rest = self.arguments
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):
            depth += ch == "(" or -(ch == ")")
            if depth == 0:
                end = i
                break
        return re.findall(r"%([\w.\-]+)", rest[:end])

    def attribute(self, name: str) -> str | None:
        """The value of `name=...` (a computation or instruction name without its `%`)."""
        m = re.search(rf"\b{name}=%?([\w.\-]+)", self.text)
        return m.group(1) if m else None

    @property
    def dims(self) -> list[int]:
        """Dimensions of the (first) array of the result shape."""
        m = ARRAY.search(self.shape)
        return [int(d) for d in m.group(2).split(",") if d] if m else []

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def is_root(self) -> bool:
        return self.text.lstrip().startswith("ROOT ")

    @property
    def is_sync(self) -> bool:
        return '"is_sync":true' in self.text

    @property
    def kernel_strategy(self) -> str:
        """The kernel XLA annotated a collective with (its backend config's
        `kernel_strategy`): "one_shot" or "two_shot" (XLA's own all-reduce kernels, which it
        runs only in a program compiled for them), else "" (NCCL)."""
        m = _KERNEL_STRATEGY.search(self.text)
        return m.group(1).lower() if m else ""

    @property
    def replica_group(self) -> list[int] | None:
        return first_replica_group(self.text)

    def is_matmul(self) -> bool:
        if self.opcode in ("dot", "convolution"):
            return True
        if self.opcode == "custom-call":
            return bool(
                re.search(r'custom_call_target="__cu(blas|dnn)[^"]*', self.text)
                or ("xla.gpu.triton" in self.text and _SMALL_M.search(self.text))
            )
        if self.opcode == "fusion":
            return (
                self.name.startswith(("gemm_fusion", "triton_gemm", "cublas"))
                or "__triton_gemm" in self.text
                or self.op_name.endswith("dot_general")
            )
        return False


def computations(hlo: str) -> dict[str, list[Op]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m and not line.startswith(" "):
                current = "ENTRY" if m.group(1) else m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        op = parse_instruction(line)
        if op:
            comps[current].append(op)
    return comps


class Module:
    """A scheduled HLO module: its computations with name -> instruction tables."""

    def __init__(self, text: str):
        if "is_scheduled=true" not in text.split("\n", 1)[0]:
            raise HloError("the HLO module is not scheduled: pass compiled, not lowered, text")
        self.computations = computations(text)
        self._by_name = {c: {op.name: op for op in ops} for c, ops in self.computations.items()}

    @property
    def entry(self) -> list[Op]:
        return self.computations["ENTRY"]

    def op(self, comp: str, name: str) -> Op | None:
        return self._by_name.get(comp, {}).get(name)

    def called(self, op: Op) -> str | None:
        return op.attribute("calls")

    def loop_bodies(self) -> set[str]:
        """The computations that run as a while loop's body."""
        return {
            body
            for ops in self.computations.values()
            for op in ops
            if op.opcode == "while"
            for body in re.findall(r"body=%?([\w.\-]+)", op.text)
        }

    def collective(self, op: Op) -> str | None:
        """Which collective `op` is or starts (an `async-start` says through the computation
        it wraps); None for anything else (`*-done` included)."""
        base = op.opcode.removesuffix("-start")
        if base == "async":
            base = next(
                (
                    o.opcode
                    for o in self.computations.get(self.called(op), ())
                    if o.opcode in COLLECTIVES
                ),
                "",
            )
        return base if base in COLLECTIVES else None

    def done_of(self, comp: str, index: int) -> int | None:
        """Index in `comp` of the `*-done` that finishes the async op at `index`."""
        ops = self.computations[comp]
        name = ops[index].name
        return next(
            (
                j
                for j in range(index + 1, len(ops))
                if ops[j].opcode.endswith("-done") and ops[j].operands[:1] == [name]
            ),
            None,
        )


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-$]+)\(")


def parse_instruction(line: str) -> Op | None:
    """`name = shape opcode(...)`; a tuple shape is matched by its parentheses (it may hold
    `/*index=5*/` comments and nested tuples)."""
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
        rest = " " + rest
    o = _OPCODE.match(rest)
    return Op(m.group(1), shape, o.group(1), line) if o else None


# ---------------------------------------------------------------------------------------------
# Replica groups.


def _iota(dims: list[int], perm: list[int] | None):
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def first_replica_group(text: str) -> list[int] | None:
    """The device ids of the first replica group of a collective, from any of XLA's spellings:
    `{{0,1},{2,3}}`, `[2,2]<=[4]` (iota, optionally transposed `T(1,0)`), or
    `mesh['axis_0'=2,'axis_1'=4](, device_ids=(...))? {'axis_0'}` (groups along the named axes of
    a device mesh). A collective-permute's `source_target_pairs={{0,1},...}` gives the devices
    of its pairs."""

    m = re.search(r"replica_groups=\{\{([\d,]*)\}", text)
    if m:
        return [int(x) for x in m.group(1).split(",") if x]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        ids = _iota(
            [int(x) for x in m.group(3).split(",")],
            [int(x) for x in m.group(4).split(",")] if m.group(4) else None,
        )
        return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
        r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
        text,
    )
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        n = int(np.prod(sizes))
        ids = (
            _iota(
                [int(x) for x in m.group(2).split(",")],
                [int(x) for x in m.group(3).split(",")] if m.group(3) else None,
            )
            if m.group(2)
            else np.arange(n)
        ).reshape(sizes)
        along = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        index = tuple(slice(None) if i in along else 0 for i in range(len(sizes)))
        return ids[index].reshape(-1).tolist()
    m = re.search(r"source_target_pairs=\{([\d,{}]*)\}", text)
    if m:
        return sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
    return None
