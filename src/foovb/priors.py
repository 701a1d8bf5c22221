"""The initial posterior (the prior of the first mini-batch) of the diagonal and full families: its std per tensor.

`std_init` is either one number for every parameter (the paper's sigma_init, 0.047 on discrete permuted MNIST) or
"xavier": each layer's own std, sqrt(2 / (fan_in + fan_out)). That is the std of Xavier-normal initialisation and of
the paper's initialisation of the diagonal family's means (appendix "Implementation details": variance
2 / (n_input + n_output)); on the paper's 784 -> 100 first layer it is 0.0476, the paper's sigma_init 0.047. Unlike one
global number it follows the layer: a 100 -> 10 head gets 0.135 (docs/results.md, "The default prior").
It depends on the shapes only, never on the values: a pretrained or an all-zero weight gets the same prior as a
freshly initialised one, and the means are the model's weights (init="keep") whatever their scale.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .posteriors import DiagonalBlock, FullBlock, KroneckerBlock, PosteriorBlock, output_layer_blocks

XAVIER = "xavier"
AUTO = "auto"  # the default posterior: matrix-variate where affordable, diagonal elsewhere
AUTO_MAX_FEATURES = 1024  # posterior="auto": the most inputs (fan_in) and outputs of a matrix-variate layer
PAPER_STD_INIT = 0.047  # the paper's sigma_init (appendix, "Discrete permuted MNIST")
# the layers of Algorithm 3: a weight (out, in, *kernel) read as an out x (in x kernel) matrix, its bias a column
MATRIX_VARIATE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def fans(tensor: Tensor) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of two or more dimensions, torch's convention: Linear (out, in) gives
    (in, out); a convolution (out, in / groups, *kernel) gives (in / groups, out) times the kernel's size."""
    receptive_field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


def xavier_std(param: Tensor, module: nn.Module | None = None) -> float:
    """sqrt(2 / (fan_in + fan_out)) of `param`, the prior std that std_init="xavier" gives it.

    The fans are the tensor's own when it has two or more dimensions, else those of the first parameter of two or
    more dimensions of its module (a Linear/Conv bias takes its weight's, also where the weight is parametrized:
    torch.nn.utils.parametrizations' spectral_norm, weight_norm). An embedding table (nn.Embedding,
    nn.EmbeddingBag) is a Linear layer on one-hot inputs: fan_in 1, fan_out its embedding_dim. A parameter with
    neither (the scale and shift of a norm layer, a scalar) or with no elements takes the paper's sigma_init, 0.047.
    """
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and param is module.weight and param.numel():
        # a Linear layer on one-hot inputs: each output row sees one active input, so fan_in is 1 (not the
        # vocabulary's size, which would make the std of a 20,000-word table 0.01 and its rows barely move)
        return math.sqrt(2.0 / (1 + module.embedding_dim))
    candidates = [param] if param.ndim >= 2 else [p for p in (module.parameters(recurse=False) if module else ())
                                                   if p.ndim >= 2]
    if not candidates and module is not None and parametrize.is_parametrized(module, "weight"):
        # a parametrized layer's bias (spectral_norm, weight_norm): the fans of the weight's largest original tensor
        # (weight_norm's direction v, not its magnitude g), not module.weight, whose evaluation would advance
        # spectral_norm's power iteration
        candidates = sorted((p for p in module.parametrizations["weight"].parameters() if p.ndim >= 2),
                            key=lambda original: original.numel(), reverse=True)
    if not candidates or candidates[0].numel() == 0:
        return PAPER_STD_INIT
    fan_in, fan_out = fans(candidates[0])
    return math.sqrt(2.0 / (fan_in + fan_out))


def initial_std(std_init: float | str, param: Tensor, module: nn.Module | None = None) -> float:
    """The initial posterior std of `param`: std_init itself, or its `xavier_std` for std_init="xavier"."""
    return xavier_std(param, module) if std_init == XAVIER else float(std_init)


@torch.no_grad()
def paper_init(model: nn.Module, generator: torch.Generator, random_bias: bool) -> None:
    """The appendix's initialisation of the means: Linear/Conv weights N(0, 2 / (fan_in + fan_out)), biases 0
    (`random_bias`: the BGD code's N(0, 2 / (1 + fan_out))). Frozen parameters are left alone."""
    for module in model.modules():
        if isinstance(module, MATRIX_VARIATE_LAYERS):  # frozen parameters are left alone
            std = xavier_std(module.weight)  # the appendix's variance 2 / (n_in + n_out)
            if module.weight.requires_grad:
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            if module.bias is not None and module.bias.requires_grad:
                if random_bias:
                    bias_std = math.sqrt(2.0 / (1 + fans(module.weight)[1]))
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * bias_std)
                else:
                    module.bias.zero_()

@torch.no_grad()
def alpha_init(model: nn.Module, generator: torch.Generator, alpha: float) -> dict[int, float]:
    """The matrix-variate split of Var(W_ij) = 2 / (n_in + 2) (Implementation details) for any family:
    draws the means, returns each layer's prior std."""
    layer_std = {}
    for module in model.modules():
        if isinstance(module, MATRIX_VARIATE_LAYERS) and module.weight.requires_grad:
            fan_in = module.weight[0].numel()
            mean_std = math.sqrt(2 * alpha / (fan_in + 2))
            for param in (module.weight, module.bias):
                if param is not None and param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator) * mean_std)
            layer_std[id(module)] = math.sqrt(2 * (1 - alpha) / (fan_in + 2))
    return layer_std


def check_factor_dtype(name: str, dtype: torch.dtype, posterior: str) -> None:
    """The matrix-variate and full families keep covariance square roots in the parameters' dtype: refuse half
    precision, where the updates of those factors round away and their products are slow on CPU."""
    if dtype in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"{f'module {name!r}' if name else 'the model itself'} has {dtype} parameters: the {posterior} "
            "posterior keeps its covariance square roots "
            f"in the parameters' dtype, where the fixed-point updates round away (8 bits of mantissa for bfloat16, "
            f"11 for float16) and its matrix products run ~18x slower on CPU (measured, bfloat16). Keep the model "
            "in float32 and run the forward and backward under torch.autocast(..., dtype=torch.bfloat16), which "
            "FOOVB supports, or use posterior='diagonal'")


def weight_matrices(module: nn.Module, direct: list[nn.Parameter]) -> list[tuple[nn.Parameter, nn.Parameter | None]]:
    """The (weight, bias or None) matrices of `module` that the matrix-variate posterior covers, one block each
    (none: its trainable `direct` parameters go diagonal):

    * an nn.Linear or nn.Conv1d / 2d / 3d whose trainable parameters are its weight (a parameter, not e.g.
      weight_norm's computed weight, and trainable: a frozen weight leaves a diagonal bias) and bias;
    * a recurrent layer (nn.RNN, nn.GRU, nn.LSTM and their cells; since session 52): each trainable weight matrix
      with its bias (weight_ih_l0 with bias_ih_l0, weight_hh_l0 with bias_hh_l0, ..., an LSTM's projection
      weight_hr_l0 alone; the bias of a frozen weight diagonal), none where weight_norm or a parametrization
      computes a weight. The paper's matrix-variate Gaussian is a family for any weight matrix: its update
      (Algorithm 3) reads only the samples' gradients."""
    if isinstance(module, MATRIX_VARIATE_LAYERS):
        if parametrize.is_parametrized(module, "weight"):  # a computed weight, whose evaluation would advance
            return []  # spectral_norm's power iteration
        weight = module.weight
        if (isinstance(weight, nn.Parameter) and weight.requires_grad
                and all(p is weight or p is module.bias for p in direct)):
            return [(weight, module.bias)]
        return []
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
        named = dict(module.named_parameters(recurse=False))
        weights = (getattr(module, "_flat_weights_names", []) if isinstance(module, nn.RNNBase)  # torch's names
                   else [name for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")  # of the layer's tensors
                         if getattr(module, name, None) is not None])
        if not weights or any(name not in named for name in weights):  # weight_norm / parametrize: as a Linear's
            return []
        return [(named[name], named.get("bias_" + name.removeprefix("weight_"))) for name in weights
                if name.startswith("weight_") and named[name].requires_grad]  # a frozen weight leaves its bias
    return []


def affordable_matrix_variate(weight: Tensor, bias: Tensor | None) -> bool:
    """posterior="auto": whether a weight matrix (`weight_matrices`) gets Algorithm 3 rather than the diagonal
    posterior: a float32 / float64 weight (the factors are kept in its dtype) with a trainable or absent bias, with
    at most AUTO_MAX_FEATURES inputs (fan_in: in_features, or in_channels / groups x the kernel's size) and outputs.
    The step's cost grows with the cube of the factors' sizes: on one CPU thread a K = 10 step of a 784-100-100-10
    MLP cost 3.4x the diagonal step, 784-512-10 5.1x, 784-1024-10 9.1x, 784-2047-10 25x (docs/performance.md)."""
    return (weight.dtype in (torch.float32, torch.float64)
            and (bias is None or bias.requires_grad)
            and weight[0].numel() <= AUTO_MAX_FEATURES and weight.shape[0] <= AUTO_MAX_FEATURES)


def auto_matrix_variate(module: nn.Module, matrices: list[tuple[nn.Parameter, nn.Parameter | None]]) -> bool:
    """posterior="auto": whether a layer's `weight_matrices` get Algorithm 3: every one `affordable_matrix_variate`.
    Recurrent layers too since session 55: with the step prior 64, matrix-variate GRU / LSTM layers averaged more than
    diagonal ones in all 10 drift cells of MNIST rows (by 2.2 to 10.7 points; 2 seeds) and on 3 of 4 synthetic streams
    (an LSTM counting tokens 0.577 against 0.407, a 2-layer bidirectional LSTM 0.956 against 0.832, a GRU's drifting
    AR(2) error 0.708 against 0.793; 3 seeds), and lost on a GRU sorting sines into bands (0.430 against 0.513: its
    later tasks learned less) and on i.i.d. rows at batch 16 (3.1 and 3.7 points, within 2.5 of the best baseline);
    a step 1.1-1.6x the diagonal one's there. Checked after the change on 5 more streams: better on 3, level with Adam
    on a GRU regressor (where diagonal layers blew up at 2 of 3 seeds), worse on a 2-layer LSTM that it barely trained
    (docs/results/matrix_variate_layers.md). Session 52, with the step prior
    16, had kept them diagonal (i.i.d. rows lost 3.4-4.0 points, a bidirectional LSTM 9 on one stream)."""
    return all(affordable_matrix_variate(weight, bias) for weight, bias in matrices)


def make_blocks(model: nn.Module, state: dict, generator: torch.Generator, posterior: str, settings: dict,
                layer_std: dict[int, float]) -> list[PosteriorBlock]:
    """One posterior block per trainable tensor (diagonal), per weight matrix of an nn.Linear / nn.Conv1d-3d or a
    recurrent layer (kronecker, `weight_matrices`; other tensors diagonal; "auto": the layers of
    `auto_matrix_variate`, other tensors diagonal) or per module
    (full), its state in the optimizer's per-parameter `state`; the means are the parameters' current values (the
    matrix-variate blocks draw theirs when init is not "keep")."""
    std_init, alpha, init = settings["std_init"], settings["alpha"], settings["init"]
    max_full_params, implicit_mean = settings["max_full_params"], settings["implicit_mean"]
    blocks: list[PosteriorBlock] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        direct = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not direct:
            continue
        if any(id(p) in seen for p in direct):
            raise ValueError(f"module {name!r} shares a parameter with another module (weight tying is "
                             "not supported: each parameter needs one posterior)")
        seen.update(id(p) for p in direct)
        module_std = layer_std.get(id(module))  # init="alpha": one prior std per layer
        if posterior in ("kronecker", "full"):
            check_factor_dtype(name, direct[0].dtype, posterior)
        matrices = weight_matrices(module, direct)
        if matrices and (posterior == "kronecker" or posterior == AUTO and auto_matrix_variate(module, matrices)):
            for weight, bias in matrices:
                if bias is not None and not bias.requires_grad:
                    raise ValueError(f"module {name!r}: a frozen bias with a trainable weight is not supported")
                blocks.append(KroneckerBlock(module, state[weight], alpha, generator, init, implicit_mean,
                                             (weight, bias)))
            covered = {id(p) for matrix in matrices for p in matrix if p is not None}
            diagonal = [p for p in direct if id(p) not in covered]
        elif posterior == "full":
            size = sum(p.numel() for p in direct)
            if size > max_full_params:
                need = 3 * size * size * direct[0].element_size()
                raise ValueError(
                    f"module {name!r} has {size} parameters: a full covariance needs a {size} x {size} "
                    f"square root (~{need / 2**30:.2f} GiB with the update's workspace), above "
                    f"max_full_params={max_full_params}; use posterior='kronecker' or 'diagonal', or "
                    "raise max_full_params"
                )
            blocks.append(FullBlock(direct, state[direct[0]],
                                    module_std or initial_std(std_init, direct[0], module), module, implicit_mean))
            diagonal = []
        else:
            diagonal = direct
        blocks.extend(DiagonalBlock(p, state[p], module_std or initial_std(std_init, p, module), module,
                                    settings["std_growth"], settings["cov_momentum"], implicit_mean,
                                    settings["curvature_damping"])
                      for p in diagonal)
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.padding_idx is not None \
                and module.weight.requires_grad:
            table_block = next(b for b in blocks if any(p is module.weight for p in b.params))
            _fix_padding_row(table_block, module.weight, module.padding_idx)
    if settings["diagonal_output_factor"]:  # the output layer's B kept diagonal (its statistics are made per step)
        for block in output_layer_blocks(blocks):
            if isinstance(block, KroneckerBlock):
                block.diagonal_output_factor = True
    return blocks


@torch.no_grad()
def _fix_padding_row(block: PosteriorBlock, weight: Tensor, padding_idx: int) -> None:
    """An embedding's padding row gets no gradient, so torch never changes it; a prior std there would put noise
    on every padding token of every sampled network, never reduced. Its std is 0: it stays at its value."""
    if isinstance(block, DiagonalBlock):
        block.state["std"][padding_idx] = 0
    else:  # FullBlock: the row's entries of the flat vector of all the module's parameters
        start = sum(p.numel() for p in block.params[: next(i for i, p in enumerate(block.params) if p is weight)])
        dim = weight.shape[1]
        block.state["sqrt_cov"][start + padding_idx * dim : start + (padding_idx + 1) * dim] = 0


def prior_blocks(model: nn.Module, state: dict, generator: torch.Generator, posterior: str,
                 settings: dict) -> list[PosteriorBlock]:
    """The posterior blocks of a new FOOVB, holding the prior of the first step: the means initialised as
    settings["init"] says (the matrix-variate blocks draw their own), then `make_blocks`."""
    layer_std: dict[int, float] = {}  # id(module) -> its initial std, where init sets it per layer
    if posterior != "kronecker":  # the matrix-variate blocks draw their own means ("auto": its other layers not)
        if settings["init"] == "alpha":
            layer_std = alpha_init(model, generator, settings["alpha"])
        elif settings["init"] != "keep":
            paper_init(model, generator, random_bias=settings["init"] == "bgd")
    return make_blocks(model, state, generator, posterior, settings, layer_std)
