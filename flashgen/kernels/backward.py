"""The backward pass: compile a BwdConfig's kernels and run them on torch CUDA tensors.

    kern = load_backward(128, "bf16", causal=True)
    dq, dk, dv = backward(kern, q, k, v, out, dout, lse)

Family sm90 (templates/sm90/bwd.cu.j2, FlashAttention-3's design) launches the same three roles
with TMA maps of q, k, v, dout and buffers padded to whole Q tiles (LSE * log2 e, D, and the dQ
accumulator in the main kernel's register order); a deterministic sm90 config also takes a zeroed int32 counter
per Q tile (dq_semaphore), on which its K/V tiles' dQ reduces take turns. Family sm80, on torch's current stream
(templates/sm80/bwd.cu.j2):
`{name}_pre` (D = rowsum(dO * O) in fp32; zero the fp32 dQ accumulator), `{name}` (one block per
K/V tile: dK, dV in registers, dQ added to the accumulator by fp32 atomics), `{name}_convert`
(accumulator to q's dtype). A deterministic config replaces the atomics and `_convert` by
`{name}_dq`, one block per Q tile that recomputes S, P, dP, dS over the K/V tiles it sees.
GQA/MQA: the main kernel writes each query head's dK, dV in fp32 to (batch, seqlen_k, heads,
head_dim) buffers and torch sums each group here, in fp32, then casts (as flash_attn sums its
expanded dK, dV), so dK and dV stay deterministic.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import abi, driver
from ..checks import check_qkv, usable
from ..compile import CompiledKernel, compile_kernel, target_for
from ..config import ELEM_BYTES, BwdConfig, default_bwd_config, mod_features
from ..launch import current_stream, scale_args, softcap_args, tmap_box
from ..modifiers import MAX_RANK
from ..tensors import Problem, aligned, view
from .serving import list_slots, modifier_tail

_BWD = abi.BWD.struct
_SM90_TAIL = abi.SM90_BWD.tail("lse2")  # what follows the tensor maps and BwdParams
_SM90_BWD_BYTES = abi.SM90_BWD.size
_SM90_MOD_AT = abi.SM90_MOD_BWD.offset("t0.ptr")  # where Sm90ModBwdParams' ModTensor slots start
_BWD_SERVE_TAIL = abi.BWD_SERVE.tail("cu_seqlens_q")  # what follows BwdParams
_BWD_MOD_AT = abi.BWD_SERVE_MOD.offset("t0.ptr")  # where the ModTensor slots start in BwdServeModParams
_MAP_T_TAIL = abi.BWD_SERVE_MOD.tail("map_t_num.ptr")  # the transposed map's lists, last
_TURN_TAIL = abi.SM90_MOD_BWD.tail("map_t_turn.ptr")  # sm90, deterministic with a block map: the lists' turns
_NO_SLOT = [0] * (1 + MAX_RANK)  # an empty ModTensor slot: pointer and strides
_NO_LISTS = 2 * _NO_SLOT


class ServeArgs(NamedTuple):
    """What a backward with serving features takes beyond q, k, v (BwdConfig.features must match).
    Varlen: q, k, v, out, dout are the packed tensors as one batch, (1, total, heads, head_dim), lse
    (1, heads, total_q), and the int32 offsets say where each sequence starts."""

    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    window: tuple[int, int] = (-1, -1)  # (left, right), -1 unbounded; causal: right is the diagonal
    softcap: float = 0.0
    alibi_slopes: Any = None  # fp32 (heads,) or (num_seqs, heads)
    # A kernel generated with a score_mod, mask_mod or block map (BwdConfig.modified): the forward's traced
    # modifiers (checks.Mods: score_mod, mask_mod, and block_map at the kernel's tiles), read as the forward reads them.
    mods: Any = None

    def features(self, causal: bool) -> dict[str, bool]:
        """The BwdConfig features these arguments need."""
        return {"varlen": self.cu_seqlens_q is not None,
                **mod_features(self.window, self.softcap, self.alibi_slopes is not None, causal)}


def load_backward(head_dim: int, dtype: str, causal: bool, config: BwdConfig | None = None,
                  gpu_arch: str | None = None, deterministic: bool = False) -> CompiledKernel:
    """The compiled backward for a problem: `config`, else the family default for `gpu_arch` (default: the
    current device's arch; sm90 family on Hopper). Autograd takes the tuned one (resolve.backward_kernel)."""
    if gpu_arch is None:
        gpu_arch = driver.device_info().arch
    if config is None:
        config = default_bwd_config(head_dim, dtype, causal, gpu_arch, deterministic)
    elif (config.head_dim, config.dtype, config.causal) != (head_dim, dtype, causal):
        raise ValueError(f"config {config.name} is not for head_dim={head_dim}, dtype={dtype}, causal={causal}")
    if reason := config.unfit_reason(gpu_arch):
        raise ValueError(f"{config.name} does not fit {gpu_arch}: {reason}")
    return compile_kernel(config, target_for(gpu_arch, config.family))


def pack_params(ptrs: tuple[int, ...], strides: tuple[int, ...], prob: Problem, scale: float, scale_log2: float) -> bytes:
    """The bytes of `struct BwdParams`: pointers q k v o dout lse delta dq_accum dq dk dv dk_accum
    dv_accum, then the (batch, row, head) strides of q k v o dout dq dk dv."""
    return _BWD.pack(*ptrs, *strides, prob.batch, prob.heads, prob.heads_k, prob.seqlen_q, prob.seqlen_k,
                     scale, scale_log2)


def _grad_buffer(given: Any, like: Any, name: str) -> Any:
    """A caller's gradient buffer, checked (it is written in place), or a fresh one like `like`."""
    import torch  # noqa: PLC0415

    if given is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if not isinstance(given, torch.Tensor) or given.device != like.device:
        raise TypeError(f"{name} must be a torch tensor on {like.device}")
    if given.dtype != like.dtype or tuple(given.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have dtype {like.dtype} and shape {tuple(like.shape)}; "
                         f"got {given.dtype} {tuple(given.shape)}")
    gv = view(given, name)
    if (gv.strides[3] != 1 and gv.shape[3] != 1) or not aligned(gv):
        raise ValueError(f"{name} must be contiguous in its last dim, 16-byte aligned, with strides that are "
                         "multiples of 8 elements")
    return given


def backward(kernel: CompiledKernel, q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any,
             softmax_scale: float | None = None, dq: Any = None, dk: Any = None, dv: Any = None,
             dlse: Any = None, serve: ServeArgs | None = None) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of attention(q, k, v) given the forward's `out` and `lse` and the output's
    gradient `dout`, all torch CUDA tensors in flash_attn's layout. `dq`, `dk`, `dv`, if given,
    are written in place. `dlse`, the gradient of lse (batch, heads, seqlen_q), if any: since
    d lse_i / d S_ij = P_ij, it enters as D - dlse in dS = P (dP - D). `serve`: varlen offsets and
    score modifiers, for a kernel generated with those features. Runs on torch's current stream."""
    import torch  # noqa: PLC0415

    cfg = kernel.config
    if not isinstance(cfg, BwdConfig):
        raise TypeError(f"kernel {cfg.name} is not a backward kernel (load it with load_backward)")
    wanted = {f for f, on in (serve or ServeArgs()).features(cfg.causal).items() if on}
    if cfg.modified != (serve is not None and serve.mods is not None):
        raise ValueError(f"kernel {cfg.name} " + ("reads a score_mod, mask_mod or block map: pass them as serve.mods"
                                                   if cfg.modified else "has no score_mod, mask_mod or block map: "
                                                   "serve.mods must be None"))
    if wanted != set(cfg.features):
        raise ValueError(f"kernel {cfg.name} has features {sorted(cfg.features) or 'none'}; these arguments need "
                         f"{sorted(wanted) or 'none'}")
    if softmax_scale is not None and not float(softmax_scale) > 0:  # the forward's s <= 0 (|s| on -Q or Q = 0)
        raise NotImplementedError(f"the backward needs softmax_scale > 0, not {softmax_scale!r}")
    scale, scale_log2 = scale_args(softmax_scale, cfg.head_dim)
    if scale <= 0:  # a positive scale so small that scale * log2(e) is 0 in float32
        raise NotImplementedError(f"the backward needs a softmax_scale whose float32 scale * log2(e) is > 0, "
                                  f"not {softmax_scale!r}")
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    if qv.kind != "torch":
        raise TypeError("backward takes torch CUDA tensors")
    prob = check_qkv(qv, kv, vv)
    if prob.head_dim_v is not None:
        raise ValueError(f"the backward takes q, k and v of one head dim, not {prob.head_dim} and v's "
                         f"{prob.head_dim_v} (flashgen.attention's backward pads them)")
    if prob.head_dim != cfg.head_dim or prob.dtype != cfg.dtype:
        raise ValueError(f"kernel {cfg.name} is for head_dim={cfg.head_dim}, dtype={cfg.dtype}; "
                         f"got head_dim={prob.head_dim}, dtype={prob.dtype}")
    b, sq, sk, h, hk, d = prob.batch, prob.seqlen_q, prob.seqlen_k, prob.heads, prob.heads_k, prob.head_dim
    for name, t in (("out", out), ("dout", dout)):
        tv = view(t, name)
        if tuple(tv.shape) != (b, sq, h, d) or tv.dtype != prob.dtype or tv.device != qv.device:
            raise ValueError(f"{name} must be like q: shape {(b, sq, h, d)}, {prob.dtype}, cuda:{qv.device}; "
                             f"got {tuple(tv.shape)}, {tv.dtype}, cuda:{tv.device}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != (b, h, sq) \
            or lse.device != q.device:
        raise ValueError(f"lse must be the forward's float32 (batch, heads, seqlen_q) = {(b, h, sq)} tensor on {q.device}")
    lse = lse.contiguous()
    q, k, v, out, dout = (usable(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout")))
    dq, dk, dv = _grad_buffer(dq, q, "dq"), _grad_buffer(dk, k, "dk"), _grad_buffer(dv, v, "dv")
    if b * h * sq == 0 or sk == 0:  # no query row, or no key (O = 0, P = 0): every gradient is 0
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv

    f32 = dict(dtype=torch.float32, device=q.device)
    sm90 = cfg.family == "sm90"
    span = _kernel_grid(cfg, prob, serve)  # the main and _dq kernels' (sequences, longest q, longest k)
    seqs, max_q, max_k = span
    packed90 = sm90 and cfg.varlen  # padded rows per sequence (bwd_params.cuh.j2: where each starts)
    sq_pad = cfg.seqlen_q_pad(sq + seqs * cfg.block_m if packed90 else sq) if sm90 else sq
    delta = torch.empty((b, h, sq_pad), **f32)
    lse2 = torch.empty((b, h, sq_pad), **f32) if sm90 else None
    dq_accum = None if cfg.deterministic and not sm90 else torch.empty((b, h, sq_pad, d) if sm90 else (b, sq, h, d), **f32)
    # sm90 deterministic: the count of dQ parts added to each Q tile, whose K/V tiles add in turn from 0
    semaphore = torch.zeros((b, h, sq_pad // cfg.block_m), dtype=torch.int32, device=q.device) \
        if sm90 and cfg.deterministic else None
    grouped = h != hk
    dk_accum = torch.empty((b, sk, h, d), **f32) if grouped else None
    dv_accum = torch.empty((b, sk, h, d), **f32) if grouped else None

    def ptr(t: Any) -> int:
        return 0 if t is None else t.data_ptr()

    ptrs = tuple(ptr(t) for t in (q, k, v, out, dout, lse, delta, dq_accum, dq, dk, dv, dk_accum, dv_accum))
    strides = tuple(s for t in (q, k, v, out, dout, dq, dk, dv) for s in t.stride()[:3])
    if cfg.serving and not sm90:
        params = _serve_params(cfg, prob, ptrs, strides, softmax_scale, serve, span)
        if cfg.modified:
            params = params.ljust(_BWD_MOD_AT, b"\0") + _mod_tail(cfg, serve.mods, q.get_device(), b, h)
    else:
        params = pack_params(ptrs, strides, prob, scale, scale_log2)
    if sm90:
        params = _sm90_params(params, cfg, prob, (q, k, v, dout), lse2.data_ptr(), sq_pad, serve or ServeArgs(), span,
                              ptr(semaphore))
        if cfg.modified:  # Sm90ModBwdParams: the same slots and lists as BwdServeModParams', then the turns
            params = params.ljust(_SM90_MOD_AT, b"\0") + _mod_tail(cfg, serve.mods, q.get_device(), b, h)
            turns = (list_slots((serve.mods.block_map.transposed_turns,), q.get_device(), b, h)
                     if cfg.block_map and cfg.deterministic else _NO_SLOT)
            params = (params + _TURN_TAIL.pack(*turns)).ljust(abi.SM90_MOD_BWD.size, b"\0")

    dev = q.get_device()
    driver.use_device(dev)
    ctx, stream = driver.primary_context_id(dev), current_stream(dev)
    names = cfg.kernel_names

    def launch(role: str, grid: tuple[int, int, int], threads: int, smem: int) -> None:
        fn = driver.get_function(kernel.cubin, names[role], smem, kernel.digest, ctx)
        fn.launch(grid, threads, params, stream)

    rows_b, rows_q = (seqs, max_q) if packed90 else (b, sq)  # sm90 varlen: per sequence
    launch("pre", cfg.rows_grid(rows_b, h, rows_q), cfg.row_threads, 0)
    if dlse is not None:
        if packed90:  # each sequence's rows start at its padded offset
            rows = _padded_rows(serve.cu_seqlens_q, sq, cfg.block_m, delta.shape[-1])
            delta[..., rows] = delta[..., rows] - dlse  # (advanced indexing reads a copy: assign back)
        else:
            delta[..., :sq].sub_(dlse)
    if seqs * max_k:
        launch("main", cfg.grid(seqs, h, max_k), cfg.threads, cfg.smem_bytes)
    if sm90:
        launch("convert", cfg.convert_grid(rows_b, h, rows_q), 256, 0)
    elif cfg.deterministic:
        if seqs * max_q:
            launch("dq", cfg.dq_grid(seqs, h, max_q), cfg.threads, cfg.smem_bytes)
    else:
        launch("convert", cfg.rows_grid(b, h, sq), cfg.row_threads, 0)
    if grouped:  # sum each group of query heads onto its k/v head, in fp32
        dk.copy_(dk_accum.view(b, sk, hk, h // hk, d).sum(3))
        dv.copy_(dv_accum.view(b, sk, hk, h // hk, d).sum(3))
    return dq, dk, dv


def _padded_rows(cu_seqlens_q: Any, total_q: int, block_m: int, padded: int) -> Any:
    """sm90 varlen: the padded row of each packed row (templates/sm90/bwd_params.cuh.j2's rule), within [0, padded).
    The sequence of a row is found by searchsorted, which has no device-side assert (repeat_interleave's output_size
    check does): offsets that decrease or leave the packed rows give wrong rows here, which the kernels leave out,
    never a CUDA context ended by an assert."""
    import torch  # noqa: PLC0415

    rows = torch.arange(total_q, device=cu_seqlens_q.device)
    seqs = cu_seqlens_q.shape[0] - 1
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), rows.to(cu_seqlens_q.dtype), right=True).clamp_(max=seqs - 1)
    start = cu_seqlens_q[:-1].long()
    pad_start = (start + torch.arange(seqs, device=start.device) * block_m) // block_m * block_m
    return (rows - start[seq] + pad_start[seq]).clamp_(0, padded - 1)


def _kernel_grid(cfg: BwdConfig, prob: Problem, serve: ServeArgs | None) -> tuple[int, int, int]:
    """(sequences, longest q, longest k) the main and _dq kernels' grids cover: varlen, per packed sequence over
    the longest; else per batch entry."""
    if cfg.varlen:
        return serve.cu_seqlens_q.shape[0] - 1, serve.max_seqlen_q, serve.max_seqlen_k
    return prob.batch, prob.seqlen_q, prob.seqlen_k


def _serve_params(cfg: BwdConfig, prob: Problem, ptrs: tuple, strides: tuple, softmax_scale: float | None,
                  serve: ServeArgs, grid: tuple[int, int, int]) -> bytes:
    """Bytes of `struct BwdServeParams`; `grid`: the (sequences, longest q, longest k) the main and _dq grids
    cover. Softcap: P is of softcap * tanh(S * scale / softcap), so the exponent's factor is softcap * log2(e)
    while dQ and dK keep the factor scale (launch.softcap_args)."""
    scale, scale_log2, softcap_pre = softcap_args(softmax_scale, cfg.head_dim, serve.softcap)
    alibi = serve.alibi_slopes
    tail = _BWD_SERVE_TAIL.pack(
        0 if serve.cu_seqlens_q is None else serve.cu_seqlens_q.data_ptr(),
        0 if serve.cu_seqlens_k is None else serve.cu_seqlens_k.data_ptr(),
        0 if alibi is None else alibi.data_ptr(), 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
        serve.window[0], serve.window[1], softcap_pre, *grid)
    return pack_params(ptrs, strides, prob, scale, scale_log2) + tail


def _mod_tail(cfg: BwdConfig, mods: Any, device: int, batch: int, heads: int) -> bytes:
    """The ModTensor slots of BwdServeModParams: the forward's (kernels.serving.modifier_tail: captured tensors, and
    the block map's lists, which the _dq kernel reads), then the transposed lists (the main kernel's: the query
    tiles of each key tile)."""
    fwd = modifier_tail(cfg, mods, device, batch, heads)
    lists = list_slots(mods.block_map.transposed_lists, device, batch, heads) if cfg.block_map else _NO_LISTS
    return fwd + _MAP_T_TAIL.pack(*lists)  # the forward's slots are laid out as BwdServeModParams' first six


def _sm90_params(params: bytes, cfg: BwdConfig, prob: Problem, tensors: tuple, lse2_ptr: int, sq_pad: int,
                 serve: ServeArgs, grid: tuple[int, int, int], semaphore_ptr: int = 0) -> bytes:
    """Bytes of `struct Sm90BwdParams`: TMA maps of q, k, v, dout (4-d over head_dim, seqlen, heads, batch;
    boxes of SMEM_W x block_m rows for q and dout, block_n for k and v), BwdParams, lse2, seqlen_q_pad, then
    the varlen offsets, the window, the (sequences, longest q, longest k) the grids cover and (deterministic)
    the zeroed dQ semaphores."""
    maps = []
    for t, rows, n, heads in zip(tensors, (cfg.block_m, cfg.block_n, cfg.block_n, cfg.block_m),
                                 (prob.seqlen_q, prob.seqlen_k, prob.seqlen_k, prob.seqlen_q),
                                 (prob.heads, prob.heads_k, prob.heads_k, prob.heads)):
        dims, strides, box = tmap_box(t.stride(), prob.head_dim, n, heads, prob.batch, ELEM_BYTES, cfg.smem_w, rows)
        maps.append(driver.tensor_map(prob.dtype, t.data_ptr(), dims, strides, box, cfg.row_bytes))
    cu_q, cu_k = (0 if t is None else t.data_ptr() for t in (serve.cu_seqlens_q, serve.cu_seqlens_k))
    tail = _SM90_TAIL.pack(lse2_ptr, sq_pad, cu_q, cu_k, *serve.window, *grid, semaphore_ptr)
    return (b"".join(maps) + params + tail).ljust(_SM90_BWD_BYTES, b"\0")


__all__ = ["ServeArgs", "backward", "load_backward", "pack_params"]
