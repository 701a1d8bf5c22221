"""How the loss that a closure calls backward() on relates to the paper's L_n, the batch's summed negative
log-likelihood (the cumulative cost of Eq. "variational bayes"), read from the loss's autograd graph.

FOO-VB's update uses the gradients of L_n itself: a mean loss must be multiplied back by its number of terms,
and a guess that is wrong by the batch size shrinks or inflates every update silently. So the reading accepts
only what it can tell for sure, and everything else is an error that names the one fix for the loss it saw:

- a mean over n terms (`F.cross_entropy`'s default, `.mean()`, a sum divided by its own number of terms),
  also scaled by a constant (`loss / 2`, `-logp.mean()`) or added to another mean over the same n terms
  (label smoothing), or to a sum over the model's input rows divided by that n (label smoothing with class
  weights or ignored targets, whose n is their total weight or count): the gradients are multiplied by n (the step
  of the summed loss, `loss / 2` of a halved one);
- a loss function's `reduction="sum"` (also with label smoothing): taken as L_n;
- a `.sum()` over a tensor with one leading row per row of the model's input (per-example losses): taken as L_n;
  a `.sum()` or `.mean()` of a one-element tensor, and a reshape, clone, cast, expand or transpose of one, is
  looked through (`F.cross_entropy(out, y).sum()` and `.mean()` are the mean); where the tensor under it cannot be
  read, it is the loss of a batch of one row (per-example losses), and an error for any other batch;
- `loss.backward(g)` of a scalar g: the loss times g; a loss plus or minus a constant (a number, a detached
  tensor): the loss, as the constant has no gradient;
- anything else (a mean plus a regulariser, a `.sum()` over a stack of losses, over more or fewer rows than the
  batch has) is an error.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["LossReduction", "loss_reduction_of", "loss_scale"]

_NO_BACKWARD = "no backward() seen"
_COMBINATIONS = ("AddBackward0", "SubBackward0")
# operations that give the same value when applied to a one-element tensor (the loss and every node _read
# reaches through a constant or a combination has one element)
# (not a slice or an index, whose input may be larger: losses[:1])
_SHAPE_ONLY = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
               "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3", "CloneBackward0",
               "ToCopyBackward0", "AliasBackward0", "ExpandBackward0", "RepeatBackward0", "PermuteBackward0",
               "TBackward0", "TransposeBackward0")


class LossReduction(NamedTuple):
    """What `loss_reduction_of` read: `kind` "mean", "sum" or, for a loss that is neither, the name of the
    operation that made it (e.g. "AddBackward0" for loss + regulariser).

    terms: a mean's number of terms (its divisor); a `.sum()`'s number of leading rows (nan for a loss function's
    reduction="sum", which is trusted); nan otherwise. mean_inside: for a loss that is neither, the number of
    terms of a mean among its operands (a mean loss plus a regulariser), else nan. factor: the constant the mean or
    sum was multiplied by last (constants inside a sum of two means over the same terms, as in label smoothing,
    weigh each example's terms and are not counted). divided_by: the constant a `.sum()` (also of one row) was
    divided by where it is not its own count (a total weight, a count of the targets kept, a mask's count).
    summed_rows: a mean read from such a sum added to a mean over divided_by terms (label smoothing with class
    weights or ignored targets): the sum's leading rows, which must be per-example terms (`loss_scale` checks).
    """

    kind: str
    terms: float
    mean_inside: float = math.nan
    factor: float = 1.0  # a constant the reduction was multiplied by (loss / 2: 0.5)
    of_one_row: str = ""  # "sum" / "mean" of a one-element tensor made by `kind`: a batch's loss if it has one row
    values: float = math.nan  # a .sum()'s number of values summed (rows x tokens of a per-token loss)
    divided_by: float = math.nan  # a .sum() divided by a constant other than its own counts (a total weight)
    summed_rows: float = math.nan  # a mean that holds such a sum: the sum's leading rows


def _constant_operand(node: object) -> tuple[object, float] | None:
    """The autograd input of a multiplication / division by a constant scalar, and the multiplier (1 for a
    negation: the sign belongs to each example's loss, as in -logp.mean()); None for any other node."""
    name = type(node).__name__
    if name == "NegBackward0":
        return node.next_functions[0][0], 1.0
    if name in ("MulBackward1", "DivBackward1"):  # by a Python number
        value = float(node._saved_other)
        return node.next_functions[0][0], value if name == "MulBackward1" else _inverse(value)
    if name in ("MulBackward0", "DivBackward0"):
        first, second = node.next_functions[0][0], node.next_functions[1][0]
        if second is None and getattr(node, "_saved_other", None) is not None and node._saved_other.numel() == 1:
            value = float(node._saved_other)
            return first, value if name == "MulBackward0" else _inverse(value)
        if name == "MulBackward0" and first is None and getattr(node, "_saved_self", None) is not None \
                and node._saved_self.numel() == 1:
            return second, float(node._saved_self)
    return None


def _inverse(value: float) -> float:
    """1 / value; a division by 0 makes a non-finite loss (inf), refused as such."""
    return 1 / value if value else math.inf


_ROW_MEANS = ("MultiMarginLossBackward0", "MultilabelMarginLossBackward0")
"""Loss functions whose reduction="mean" averages over the input's rows, not its values: each row's loss is the mean
over its C classes already (F.multi_margin_loss, F.multilabel_margin_loss)."""
_CTC_MEAN = "F.ctc_loss's reduction='mean'"


def _holds_ctc_loss(node: object, depth: int = 3) -> bool:
    """Whether `node` is F.ctc_loss's, or holds it within `depth` levels of inputs (zero_infinity=True puts a where
    on it)."""
    if node is None or depth == 0:
        return False
    return "CtcLoss" in type(node).__name__ or any(_holds_ctc_loss(child, depth - 1)
                                                   for child, _ in node.next_functions)


def _divisor(node: object) -> float | None:
    """The constant a DivBackward node divides by."""
    name = type(node).__name__
    if name == "DivBackward0" and node.next_functions[1][0] is None:
        return float(node._saved_other)
    if name == "DivBackward1":
        return float(node._saved_other)
    return None


def _read(node: object, depth: int = 0) -> LossReduction:
    if node is None:
        return LossReduction("no graph", math.nan)
    if depth >= 16:
        return LossReduction("a graph too deep to read", math.nan)
    name = type(node).__name__
    constant = _constant_operand(node)
    if constant is not None:
        found = _read(constant[0], depth + 1)
        divisor = _divisor(node)
        # a .sum() over n rows divided by n is a mean over them (F.cross_entropy's label smoothing term), one over
        # all its values divided by their number a mean over those (a per-token loss of shape (rows, tokens))
        if "sum" in (found.kind, found.of_one_row) and found.factor == 1 and divisor is not None:
            if found.kind == "sum" and divisor in (found.terms, found.values):
                return LossReduction("mean", divisor)
            return found._replace(factor=constant[1], divided_by=divisor)  # by a total weight, a count kept
        return found._replace(factor=found.factor * constant[1])
    if name in _SHAPE_ONLY:  # a one-element tensor reshaped, cloned or cast: itself
        return _read(node.next_functions[0][0], depth + 1)
    if name.startswith(("SumBackward", "MeanBackward")):
        sizes = tuple(node._saved_self_sym_sizes)
        if math.prod(sizes) == 1:  # the sum or mean of a one-element tensor: itself
            inner = _read(node.next_functions[0][0], depth + 1)
            if inner.kind in ("mean", "sum") or not math.isnan(inner.mean_inside):
                return inner  # F.cross_entropy(out, y).mean() is the mean, not a mean over 1 term
            # the per-example loss of a batch of one row, or something unread (loss.clamp(max=50).sum())
            return inner._replace(of_one_row="sum" if name.startswith("Sum") else "mean")
    if name.startswith("SumBackward"):
        source = type(node.next_functions[0][0]).__name__
        if source in ("StackBackward0", "CatBackward0"):  # a sum over a list of losses, not over examples
            return LossReduction(f"a .sum() over a {source[:-9].lower()} of values", math.nan)
        return LossReduction("sum", float(sizes[0]) if sizes else 1.0, values=float(math.prod(sizes)))
    if name.startswith("MeanBackward"):
        source = node.next_functions[0][0]
        if type(source).__name__ in ("StackBackward0", "CatBackward0"):  # a mean of losses, each over its own terms
            return LossReduction(f"a .mean() over a {type(source).__name__[:-9].lower()} of values", math.nan)
        if type(source).__name__ == "DivBackward0" and _holds_ctc_loss(source.next_functions[0][0]):
            return LossReduction(_CTC_MEAN, math.nan)  # each row's loss divided by its target length, then the mean
        return LossReduction("mean", float(math.prod(node._saved_self_sym_sizes)))
    reduction = getattr(node, "_saved_reduction", None)  # torch's loss functions: 1 mean, 2 sum
    if reduction == 2:
        return LossReduction("sum", math.nan)
    if reduction == 1:
        total_weight = getattr(node, "_saved_total_weight", None)  # nll_loss: the sum of the rows' weights
        if total_weight is not None:
            return LossReduction("mean", float(total_weight))
        values = node._saved_self
        if name in _ROW_MEANS:  # each row's loss is already divided by its C values: the mean is over the rows
            return LossReduction("mean", float(values.shape[0]) if values.ndim == 2 else 1.0)
        return LossReduction("mean", float(values.numel()))
    if name in _COMBINATIONS:
        children = [child for child, _ in node.next_functions]
        parts = [_read(child, depth + 1) for child in children if child is not None]
        if len(parts) == 1 and (children[0] is not None or getattr(node, "_saved_alpha", 1) == 1):
            return parts[0]  # plus or minus a constant (a number, a detached tensor): it has no gradient
        # two means over the same terms (label smoothing: (1 - e) nll + e smooth): a mean of each example's
        # weighted terms; equal weights (0.5 a + 0.5 b) are a constant of the whole loss
        factor = parts[0].factor if len(parts) == 2 and parts[0].factor == parts[1].factor else 1.0
        if len(parts) == 2 and parts[0].kind == parts[1].kind == "mean" and parts[0].terms == parts[1].terms:
            return LossReduction("mean", parts[0].terms, factor=factor)
        # label smoothing with class weights or ignored targets: nll's mean over their total weight (or count) T
        # plus the smoothing term's sum over the rows divided by T, a mean of each row's weighted terms over T
        # (if those rows are the model's input's: loss_scale checks)
        mean, summed = sorted(parts, key=lambda part: part.kind != "mean") if len(parts) == 2 else (None, None)
        if mean is not None and mean.kind == "mean" and "sum" in (summed.kind, summed.of_one_row) and math.isclose(
                summed.divided_by, mean.terms, rel_tol=1e-5):  # (a one-row batch's: a .sum() of one element)
            return LossReduction("mean", mean.terms, summed_rows=summed.terms if summed.kind == "sum" else 1.0)
        if len(parts) == 2 and parts[0].kind == parts[1].kind == "sum":  # label smoothing with reduction="sum"
            rows = {part.terms for part in parts if not math.isnan(part.terms)}
            if len(rows) <= 1:
                return LossReduction("sum", rows.pop() if rows else math.nan, factor=factor)
        if len(parts) == 2 and any(part.of_one_row for part in parts) and all(
                part.of_one_row or part.kind == "sum" or (part.kind == "mean" and part.terms == 1) for part in parts):
            # label smoothing on one row: a mean over 1 term (or a sum) plus a .sum() of one element; the batch's
            # loss if the batch has one row (loss_scale checks)
            return LossReduction(name, math.nan, of_one_row="sum" if any(p.kind == "sum" for p in parts) else "mean")
        means = [part.terms if part.kind == "mean" else part.mean_inside for part in parts]
        return LossReduction(name, math.nan, next((n for n in means if not math.isnan(n)), math.nan))
    return LossReduction(name, math.nan)


def loss_reduction_of(loss: Tensor) -> LossReduction:
    """How a scalar loss was reduced over its terms, read from the last operations of its autograd graph (the
    rules: this module's docstring). Must be called before backward(), which frees what the graph saved."""
    if loss.grad_fn is None:
        return LossReduction("no graph", math.nan)
    if loss.numel() != 1:
        return LossReduction("a non-scalar loss", math.nan)
    return _read(loss.grad_fn)


def loss_scale(reduction: LossReduction | None, declared: str, batch_size: int | None,
               rows: frozenset[int]) -> float:
    """The factor that turns the gradients of a loss reduced as `reduction` into those of L_n.

    declared: the optimizer's loss_reduction ("auto", "sum" or "mean"); batch_size: step(closure, batch_size=n);
    rows: the leading sizes of the model's inputs in the closure (empty if the model was not called on a tensor).
    Raises ValueError, naming the fix, for a loss whose relation to L_n cannot be told for sure.
    """
    kind, terms, mean_inside, factor, of_one_row, values, divided_by, summed_rows = (
        reduction if reduction is not None else LossReduction(_NO_BACKWARD, math.nan))
    if not math.isnan(summed_rows) and not any(summed_rows % row == 0 for row in rows):  # rows, or tokens of
        kind, terms, mean_inside = "AddBackward0", math.nan, terms  # them flattened; else not per-example terms
    if of_one_row and rows == frozenset({1}):  # the per-example loss of a batch of one row, summed or averaged
        kind, terms = of_one_row, 1.0
    if kind == _CTC_MEAN:  # whatever else is said: no batch_size or loss_reduction turns it into L_n
        raise ValueError(
            "the loss is F.ctc_loss's reduction='mean', which divides each sequence's loss by its target length "
            "before averaging: not a multiple of the batch's summed negative log-likelihood, so no number of terms "
            "turns it into that; use reduction='sum'")
    if factor == 0:
        raise ValueError("the loss is multiplied by 0: its gradients are zero, and FOO-VB needs those of the "
                         "batch's negative log-likelihood")
    if not math.isfinite(factor):  # a non-finite loss: the update refuses it (FloatingPointError), whatever its scale
        return 1.0
    if kind in ("mean", "sum") and factor >= 2 ** 8 and math.frexp(factor)[0] == 0.5:  # whatever else is said
        raise ValueError(
            f"the loss is {factor:g} times a {kind}: a loss scaled by torch.amp.GradScaler (its scales are powers "
            f"of 2, {2 ** 16} at the start)? FOO-VB needs the unscaled loss's gradients: train without the scaler "
            "(bfloat16 autocast needs none); a factor of your own that scales the whole batch (a dataset size): "
            "drop it from the loss")
    batch = next(iter(rows)) if len(rows) == 1 else None
    n = batch if batch is not None else (None if math.isnan(mean_inside) else f"{mean_inside:g}")
    if batch_size is not None:
        if kind == "sum" and not math.isnan(divided_by):  # a masked mean over D values is multiplied by D, a scaled
            if math.isclose(batch_size, divided_by, rel_tol=1e-5):  # sum by nothing: no other n fits
                return float(batch_size)
            what = f"a .sum() over {terms:g} rows" if not math.isnan(terms) else "a loss function's sum"
            count = (f"takes batch_size={round(divided_by)}, the count at every step" if
                     math.isclose(divided_by, round(divided_by), rel_tol=1e-5) and round(divided_by) >= 1
                     else "cannot be given as a batch_size (not a whole number): use FOOVB(..., "
                     "loss_reduction='sum') on the sum itself")
            raise ValueError(
                f"step(closure, batch_size={batch_size}) says the loss is a mean over {batch_size} terms, but it "
                f"is {what} divided by {divided_by:g}: a mean over {divided_by:g} values (a masked mean, "
                f".sum() / mask.sum()) {count}; a sum whose 1/{divided_by:g} belongs to each example's loss takes no "
                "batch_size, with FOOVB(..., loss_reduction='sum')")
        if kind == "sum" and (math.isnan(terms) or terms == batch_size):  # a loss function's sum, or over the rows
            raise ValueError(f"step(closure, batch_size={batch_size}) says the loss is a mean, but it is a sum: "
                             "drop batch_size")
        if kind == "mean" and factor == 1 and terms != batch_size:  # it can be read, and says otherwise
            raise ValueError(f"step(closure, batch_size={batch_size}) says the loss is a mean over {batch_size} "
                             f"terms, but it is a mean over {terms:g} (the values it averages): drop batch_size, "
                             f"and the step multiplies it by {terms:g} itself")
        return float(batch_size)
    if declared == "sum":
        if kind == "mean" or not math.isnan(mean_inside):
            what = (f"is a mean over {terms:g} terms" if kind == "mean" else
                    f"adds other terms to a mean over {mean_inside:g} terms (its last operation: {kind})")
            fix = ("use reduction='sum' in the loss function" if kind == "mean" else
                   f"keep loss_reduction='auto' and call step(closure, batch_size={n or 'n'})")
            raise ValueError(f"loss_reduction='sum' says the loss is the batch's summed negative log-likelihood, "
                             f"but it {what}: {fix}")
        return 1.0
    if kind == "mean" and factor == 1:
        return terms
    if kind == "mean" and factor == terms:  # a mean times its number of terms: a sum written by hand
        return 1.0
    if kind == "sum" and factor != 1:
        row = next((r for r in (terms, *rows) if not math.isnan(r) and factor * r == 1), None)
        if row is not None:  # a sum divided by the batch's rows: a mean written by hand
            return float(row)
    if kind in ("mean", "sum") and factor != 1 and declared != "mean":
        over = f" over {terms:g} terms" if not math.isnan(terms) else ""
        each = (f"step(closure, batch_size={terms:g})" if kind == "mean" else "FOOVB(..., loss_reduction='sum')")
        whole = terms / factor if kind == "mean" else 1 / factor
        batch = (f"step(closure, batch_size={whole:g})" if kind == "mean" and float(whole).is_integer() and whole >= 1
                 else "drop it from the loss (FOO-VB needs the batch's own likelihood)")
        counted = 1 / factor  # a .sum() divided by a count of its values: a mean over those (a masked mean)
        summed = f" of the {values:g} values summed" if not math.isnan(values) else " of the values summed"
        masked = (f"for a mean over {counted:g}{summed} (a masked mean, .sum() / mask.sum()), give that count at "
                  f"every step: step(closure, batch_size={counted:g})"
                  if kind == "sum" and math.isclose(counted, round(counted)) and round(counted) > 1 else "")
        if masked and round(counted) > 2:  # a count first; a factor 1/2 is more likely a Gaussian's
            raise ValueError(
                f"the loss is {factor:g} times a {kind}{over}: {masked}. Else, whether {factor:g} belongs to each "
                f"example's loss or scales the whole batch cannot be read from it: {each} for the first, "
                f"{batch} for the second")
        weighted = ("; a weighted mean ((w * losses).sum() / w.sum()): drop the division, and the step reads the "
                    "weighted sum as the batch's summed negative log-likelihood, as it reads F.cross_entropy's "
                    "weight= mean" if kind == "sum" and not math.isclose(counted, round(counted)) else "")
        raise ValueError(
            f"the loss is {factor:g} times a {kind}{over}. Whether {factor:g} belongs to each example's loss "
            f"(a Gaussian's 1/2) or scales the whole batch (1/k over k micro-batches, a dataset size) cannot be "
            f"read from it. The first: {each}; the second: {batch}{weighted}")  # (a masked mean over 2: unlikely)
    if declared == "mean":
        what = (f"it is {factor:g} times a mean" if kind == "mean" else
                f"its last operation is {'a sum' if kind == 'sum' else kind}")
        raise ValueError(f"loss_reduction='mean' says the loss is a mean, but {what}: return the mean, or call "
                         f"step(closure, batch_size={n or 'n'}) to give its number of terms")
    if kind == "sum":
        if math.isnan(terms) or terms in rows:  # a loss function's reduction="sum", or one term per input row
            return 1.0
        seen = (f"the model's input has {' or '.join(str(r) for r in sorted(rows))} rows" if rows else
                "the model was not called on a tensor in the closure")
        raise ValueError(
            f"the loss is a .sum() over {terms:g} leading rows, but {seen}: it cannot be told to be the batch's "
            "summed negative log-likelihood. If it is, say so with FOOVB(..., loss_reduction='sum'), or use "
            "the loss function's reduction='sum'")
    if not math.isnan(mean_inside):
        if batch is not None and mean_inside > batch and (mean_inside / batch).is_integer():  # several values a row
            what = (f"a mean over N values, N the number the likelihood's mean averages (a plain mean loss is "
                    f"multiplied by it): {batch} if one per row of the batch (F.cross_entropy), {mean_inside:g} if "
                    f"the mean over {mean_inside:g} values read here is the likelihood's (F.mse_loss over "
                    f"{mean_inside / batch:g} outputs per row, a per-token loss)")
            call = "step(closure, batch_size=N)"
        else:
            what, call = "a mean over the batch", f"step(closure, batch_size={n or 'n'})"
        raise ValueError(
            f"the loss adds a mean over {mean_inside:g} terms to something else ({kind}: e.g. a regulariser), so "
            f"how it relates to the batch's summed negative log-likelihood cannot be read from it: call {call} to "
            f"say it is {what} (everything is multiplied by it: a term that is already a sum over the batch, such "
            "as output_anchor(..., reduction='sum'), would be counted that many times; give it the loss's "
            "reduction instead)")
    if kind == _NO_BACKWARD:
        raise ValueError(
            "the closure filled the gradients without calling backward() on a loss (gradients computed by "
            "torch.autograd.grad and written into .grad are not seen, nor torch.autograd.backward on a torch "
            "whose autograd.backward has no torch-function dispatch), so how the loss was reduced cannot be read: "
            "call loss.backward() "
            f"in the closure, or say it: step(closure, batch_size={n or 'n'}) for a mean over the batch's rows, "
            "FOOVB(..., loss_reduction='sum') for their sum")
    if kind == "a non-scalar loss":
        raise ValueError("the loss is not a scalar (a loss function's reduction='none'?): return its mean or its sum "
                         "over the batch (F.cross_entropy(out, y), or losses.sum())")
    raise ValueError(
        f"cannot tell how the loss was reduced over the batch (its last operation: {kind}): call backward() on the "
        f"loss function's output itself (its mean, or reduction='sum'), call step(closure, "
        f"batch_size={n or 'n'}) if the loss is a mean over the batch's rows, or FOOVB(..., loss_reduction='sum') "
        "if it is the batch's summed negative log-likelihood (plus a regulariser)")


def check_batch_size_fits(reduction: LossReduction, batch_size: int, rows: frozenset[int]) -> None:
    """Refuse step(closure, batch_size=n) where n is more than anything one backward() call's loss can count: the
    values its mean averages (also inside a mean plus a regulariser), that count over the constant the loss is
    scaled by (the whole batch of micro-batches, (loss + reg) / k), and the rows of the model's input. Such an n is a
    count kept from a larger batch or a dataset size: a likelihood that many times too strong, silently. Smaller
    counts cannot be told from a regularised mean's own (which of its means is the likelihood's is not read)."""
    averaged = reduction.terms if reduction.kind == "mean" else reduction.mean_inside
    if math.isnan(averaged) or not math.isfinite(reduction.factor) or reduction.factor == 0:
        return
    counts = [averaged, averaged / abs(reduction.factor), *rows]
    if batch_size > max(counts) * (1 + 1e-6):
        seen = f"; the model's input has {' or '.join(str(r) for r in sorted(rows))} rows" if rows else ""
        raise ValueError(
            f"step(closure, batch_size={batch_size}) says the loss is a mean over {batch_size} terms, more than it "
            f"can count: its mean averages {averaged:g} values{seen}. A count kept from a larger batch (for a "
            "smaller last one) or a dataset size? Give this batch's own count at every step")


def reads_a_mean(reduction: LossReduction | None, declared: str, batch_size: int | None,
                 rows: frozenset[int]) -> bool:
    """Whether a loss that `loss_scale` accepted is a mean over the batch's rows (its scale turned it into their
    sum; a mean over one row too), not their sum: over how many rows the reported loss of a data-parallel step
    averages. A sum divided by the rows by hand is a mean; a mean multiplied by its terms by hand, a sum."""
    if batch_size is not None:
        return True
    if reduction is None or declared == "sum":
        return False
    kind, factor, of_one_row = reduction.kind, reduction.factor, reduction.of_one_row
    if of_one_row and rows == frozenset({1}):
        kind = of_one_row
    return (kind == "mean" and factor == 1) or (kind == "sum" and factor != 1)


_ACTIVE_SPIES: list[LossSpy] = []  # the spies of the steps running now (a step inside a step's closure: two)
_MODULE_HOOKS: list = []  # the two global module hooks, while an optimizer that may spy lives
_HOOK_HOLDERS = [0]  # how many live optimizers hold them


def hold_module_hooks(owner: object) -> None:
    """Global module hooks that tell the active spies of every module call (the closure may call the model or only
    its submodules: Lightning's self.net(x)), held while `owner` (an optimizer) lives: registered with the first
    holder, removed with the last. Not per step: torch.compile guards on the global hooks, and a new hook every step
    recompiled the user's compiled model at every step (10x slower steps). With no active spy they return at once."""
    if not _MODULE_HOOKS:
        _MODULE_HOOKS.extend([nn.modules.module.register_module_forward_pre_hook(_enter_module),
                              nn.modules.module.register_module_forward_hook(_leave_module)])
    _HOOK_HOLDERS[0] += 1
    weakref.finalize(owner, _release_module_hooks)


def _release_module_hooks() -> None:
    _HOOK_HOLDERS[0] -= 1
    if _HOOK_HOLDERS[0] == 0:
        for handle in _MODULE_HOOKS:
            handle.remove()
        _MODULE_HOOKS.clear()


def _enter_module(module: nn.Module, args: tuple) -> None:
    for spy in _ACTIVE_SPIES:
        spy.enter_module(module, args)


def _leave_module(module: nn.Module, args: tuple, output: object) -> None:
    for spy in _ACTIVE_SPIES:
        spy.leave_module(module)


class LossSpy(TorchFunctionMode):
    """Reads `loss_reduction_of` every tensor that backward() is called on (before the graph is freed), and the
    leading size of the model's tensor inputs. The closure's returned loss cannot serve: Lightning returns a
    detached copy, and backward has run."""

    def __init__(self, model: nn.Module, watched: dict[int, nn.Module] | None = None) -> None:
        super().__init__()
        self.modules = {id(module) for module in model.modules()}
        self.watched = watched or {}  # modules whose calls before backward() are followed: `last_watched`, the
        # last one called
        self.last_watched: nn.Module | None = None
        self.reductions: list[LossReduction] = []
        self.losses: list[float] = []
        self.rows: set[int] = set()  # leading sizes of the inputs of the outermost calls into the model
        self._depth = 0

    def __enter__(self) -> LossSpy:
        if not _MODULE_HOOKS:
            raise RuntimeError("LossSpy needs the module hooks of a live optimizer (hold_module_hooks)")
        _ACTIVE_SPIES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_SPIES.remove(self)
        super().__exit__(*exc)

    def enter_module(self, module: nn.Module, args: tuple) -> None:
        if id(module) not in self.modules:
            return
        if id(module) in self.watched and not self.reductions:  # not after backward() (a checkpoint's recompute)
            self.last_watched = module
        if self._depth == 0:
            first = next((a for a in args if isinstance(a, Tensor)), None)
            if first is not None and first.ndim:
                self.rows.add(first.size(0))  # not .shape[0]: an int in model.compile()d code
        self._depth += 1

    def leave_module(self, module: nn.Module) -> None:
        if id(module) in self.modules:
            self._depth -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.autograd.backward:  # gradients given as an iterator: read once, passed on as a tuple
            if len(args) > 1 and not isinstance(args[1], (Tensor, list, tuple, type(None))):
                args = (args[0], tuple(args[1]), *args[2:])
            if not isinstance(kwargs.get("grad_tensors"), (Tensor, list, tuple, type(None))):
                kwargs = {**kwargs, "grad_tensors": tuple(kwargs["grad_tensors"])}
        if func is Tensor.backward or func is torch.autograd.backward:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args: tuple, kwargs: dict) -> None:  # noqa: ANN001
        """One reduction per loss of a backward call: `loss.backward(gradient)`, or
        `torch.autograd.backward(tensors, grad_tensors)` (one loss or a sequence, a gradient per loss or None)."""
        losses = args[0] if args else kwargs.get("tensors")
        gradients = args[1] if len(args) > 1 else kwargs.get("gradient" if func is Tensor.backward else "grad_tensors")
        losses = (losses,) if isinstance(losses, Tensor) else tuple(losses or ())
        gradients = ((gradients,) if isinstance(gradients, Tensor) else
                     (None,) * len(losses) if gradients is None else tuple(gradients))
        for loss, gradient in zip(losses, gradients, strict=False):  # unequal lengths: torch raises
            if not isinstance(loss, Tensor):
                continue
            reduction = loss_reduction_of(loss)
            if gradient is not None:  # backward with a gradient g gives the gradients of g * loss
                reduction = (reduction._replace(factor=reduction.factor * float(gradient))
                             if isinstance(gradient, Tensor) and gradient.numel() == 1 else
                             LossReduction("backward() with a gradient of several elements", math.nan))
            self.reductions.append(reduction)
            self.losses.append(float(loss.detach().sum()))  # backward(gradient) of a non-scalar: its sum

    def scale(self, declared: str, batch_size: int | None) -> float:
        """The one factor for all the backward() calls of the closure (`loss_scale` of each, which must agree)."""
        if not self.reductions:
            return loss_scale(None, declared, batch_size, frozenset(self.rows))
        scales = []
        for index, reduction in enumerate(self.reductions):
            try:
                scales.append(loss_scale(reduction, declared, batch_size, frozenset(self.rows)))
            except ValueError as error:
                if len(self.reductions) == 1 or batch_size is not None:  # (batch_size: it contradicts this loss)
                    raise
                # the single-loss advice would count this loss's terms (e.g. activations), not the batch's rows,
                # and a batch_size multiplies the gradients of every backward() call alike
                accumulated = self._accumulation_advice()
                if accumulated:
                    raise ValueError(accumulated) from error
                rows = " or ".join(str(r) for r in sorted(self.rows)) or "n"
                what = (f"{reduction.factor:g} times a {reduction.kind} over {reduction.terms:g} terms"
                        if reduction.kind in ("mean", "sum") else f"made by {reduction.kind}")
                raise ValueError(
                    f"the closure called backward() {len(self.reductions)} times, and loss {index + 1} ({what}) "
                    "does not tell how it relates to the batch's summed negative log-likelihood; one factor "
                    "multiplies the gradients of all of them. Call backward() once, on the total loss, or, if every "
                    f"loss is a mean over the batch's {rows} rows, call step(closure, batch_size={rows})"
                ) from error
        if batch_size is not None and len(self.reductions) == 1:
            check_batch_size_fits(self.reductions[0], batch_size, frozenset(self.rows))
        if any(s != scales[0] for s in scales):
            raise ValueError(
                f"the closure called backward() {len(scales)} times on losses of different scales (means over "
                f"{', '.join(f'{s:g}' for s in scales)} terms, e.g. gradient accumulation over micro-batches of "
                "unequal size): one factor cannot turn their summed gradients into those of the batch's summed "
                "loss. Use the loss function's reduction='sum' for each micro-batch")
        return scales[0]

    def _accumulation_advice(self) -> str:
        """The error for gradient accumulation written as `(loss / k).backward()` per micro-batch: k backward()
        calls, each on the same constant f times a mean over the same t terms. Whether f scales the whole batch
        (1/k: the batch's k t rows) or belongs to each example's loss cannot be read; the first is the recipe's.
        "" for any other closure."""
        first = self.reductions[0]
        if first.kind != "mean" or first.factor == 1 or any(
                (r.kind, r.factor) != (first.kind, first.factor) for r in self.reductions):
            return ""
        calls, terms, factor = len(self.reductions), first.terms, first.factor
        if any(r.terms != terms for r in self.reductions):  # unequal micro-batches, or class weights: no one n
            return (f"the closure called backward() {calls} times, each on {factor:g} times a mean, over "
                    f"{', '.join(f'{r.terms:g}' for r in self.reductions)} terms: gradient accumulation over "
                    "micro-batches (loss / k)? No one batch_size turns these means into the batch's summed loss: "
                    "use the loss function's reduction='sum' for each micro-batch, without the division")
        whole = terms / factor
        shares = f" (the whole batch: {calls} x {terms:g})" if math.isclose(calls * factor, 1) else ""
        batch = (f"step(closure, batch_size={whole:g}){shares}" if float(whole).is_integer() and whole >= 1
                 else "drop the constant from each loss")
        return (f"the closure called backward() {calls} times, each on {factor:g} times a mean over {terms:g} "
                f"terms: gradient accumulation over micro-batches (loss / k)? Whether {factor:g} scales the whole "
                f"batch or belongs to each example's loss (a Gaussian's 1/2) cannot be read from it. The first: "
                f"{batch}, or drop the division and the step reads each mean itself; the second: "
                f"step(closure, batch_size={terms:g})")

    def reads_a_mean(self, declared: str, batch_size: int | None) -> bool:
        """Whether the closure's loss is a mean, not the batch's sum (`reads_a_mean`), once `scale` accepted it."""
        rows = frozenset(self.rows)
        return batch_size is not None or any(reads_a_mean(r, declared, batch_size, rows) for r in self.reductions)

    @property
    def loss(self) -> float | None:
        """The sum of the losses backward() was called on (None if it was not)."""
        return sum(self.losses) if self.losses else None
