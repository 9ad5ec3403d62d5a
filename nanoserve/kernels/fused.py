"""The fused CPU decoder kernels (fused.c) behind tensor-level calls, with counters of the calls they served.

One call replaces what eager torch runs as several ops each with its own dispatch (the norm alone is six on CPU):
on a one-row decode step that dispatch, not arithmetic, is most of a layer's time. Every row is computed alone in
a fixed order, so the kernels serve prefill and decode rows alike and the two agree bitwise.
"""

from __future__ import annotations

import ctypes

import torch

from nanoserve.kernels.build import build
from nanoserve.kernels.pages import weight_buffer

KIND = {torch.float32: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 1024  # fused.c's per-head scratch
TILE_HEIGHT = 16  # rows of activations an AMX tile holds

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = {
    "ns_add_rms_norm": (_ptr, _i64, _i64, _ptr, _i32, _ptr, _f32, _ptr, _i32),
    "ns_add": (_ptr, _i64, _ptr, _i32),
    "ns_rope_store": (_ptr, _i32, _i64, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr,
                      _i64, _i64, _i32),
    "ns_silu_mul": (_ptr, _i32, _i64, _i64, _ptr),
    "ns_rescore": (_ptr, _i64, _i64, _ptr, _ptr, _i32, _i32),
    "ns_attention": (_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i64, _i32, _ptr, _i64, _ptr, _ptr, _f32, _ptr, _i64,
                     _ptr, _i32, _i32),
}


def _kind(t: torch.Tensor) -> int:
    kind = KIND.get(t.dtype)
    if kind is None or not t.is_contiguous() or t.is_cuda:
        raise ValueError(f"fused kernels take contiguous float32 / bfloat16 CPU tensors, not {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")
    return kind


class FusedKernels:
    """The compiled library and what it served: `calls` and `rows` per kernel."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
            setattr(self, "_" + name.removeprefix("ns_"), fn)
        self._attention_scratch = lib.ns_attention_scratch
        self._attention_scratch.argtypes, self._attention_scratch.restype = (_i32, _i64, _i32), _i64
        self._q4_pack, self._q4_matmul, self._q4_bytes = lib.ns_q4_pack, lib.ns_q4_matmul, lib.ns_q4_packed_bytes
        self._q4_pack.argtypes, self._q4_pack.restype = (_ptr, _ptr, _ptr, _i64, _i64, _ptr), None
        self._q4_matmul.argtypes = (_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32, _i32)
        self._argmax_rows = lib.ns_argmax_rows
        self._argmax_rows.argtypes, self._argmax_rows.restype = (_ptr, _i64, _i64, _ptr), None
        self._q4_matmul.restype = ctypes.c_int
        self._q4_bytes.argtypes, self._q4_bytes.restype = (_i64, _i64), _i64
        self._q4_pack_gguf = lib.ns_q4_pack_gguf
        self._q4_pack_gguf.argtypes, self._q4_pack_gguf.restype = (_ptr, _i32, _i64, _i64, _ptr, _i32), None
        lib.ns_q4_isa.restype = ctypes.c_char_p
        self.q4_isa = lib.ns_q4_isa().decode()  # which integer dot product the 4-bit kernel was built on
        self._q8_pack, self._q8_matmul, self._q8_bytes = lib.ns_q8_pack, lib.ns_q8_matmul, lib.ns_q8_packed_bytes
        self._q8_pack.argtypes, self._q8_pack.restype = (_ptr, _ptr, _i64, _i64, _ptr), None
        self._q8_matmul.argtypes, self._q8_matmul.restype = self._q4_matmul.argtypes, ctypes.c_int
        self._q8_bytes.argtypes, self._q8_bytes.restype = (_i64, _i64), _i64
        # the raw C entries (packed, x, rows, in, out, bias, y, threads, accumulate) -> 0, or -1 out of memory: for
        # a caller that checked its tensors once (model/quant/linears.py's KernelLinear)
        self.q4_call, self.q8_call = self._q4_matmul, self._q8_matmul
        self.q4x8_call = lib.ns_q4x8_matmul  # Q4_0's 4-bit x 8-bit kernel (q4x8.c), q4x16's arguments
        self.q4x8_call.argtypes, self.q4x8_call.restype = self._q4_matmul.argtypes, ctypes.c_int
        self._q4x8_pack_gguf, self._q4x8_bytes = lib.ns_q4x8_pack_gguf, lib.ns_q4x8_packed_bytes
        self._q4x8_pack_gguf.argtypes, self._q4x8_pack_gguf.restype = (_ptr, _i64, _i64, _ptr, _i32), None
        self._q4x8_bytes.argtypes, self._q4x8_bytes.restype = (_i64, _i64), _i64
        lib.ns_q4x8_isa.restype = ctypes.c_char_p
        self.q4x8_isa = lib.ns_q4x8_isa().decode()
        self._bind_kquants(lib)
        self._set_tiles, self._tile_rows = lib.ns_set_tiles, lib.ns_tile_rows
        self._set_tiles.argtypes, self._set_tiles.restype = (ctypes.c_int,), ctypes.c_int
        self._tile_rows.argtypes, self._tile_rows.restype = (), _i64
        self.tiles = "amx" if self._set_tiles(1) else "none"  # the tile unit wide 4- and 8-bit calls run on
        # the weight the next matmul reads, for an idle pool worker to ask for meanwhile (linear.c): (ptr, bytes)
        self.read_ahead = lib.ns_read_ahead
        self.read_ahead.argtypes, self.read_ahead.restype = (_ptr, _i64), None
        self._read_ahead_bytes = lib.ns_read_ahead_bytes
        self._read_ahead_bytes.argtypes, self._read_ahead_bytes.restype = (), _i64
        self._tiles_on = self.tiles != "none"
        self.calls = {"norm": 0, "rope_store": 0, "attention": 0, "silu_mul": 0, "add": 0, "rescore": 0}
        self.rows = dict.fromkeys(self.calls, 0)

    def _bind_kquants(self, lib: ctypes.CDLL) -> None:
        """kquant.c: GGUF's K-quant (rarer types', 16-bit) rows as the file holds them. `kq_types`: type name -> the
        library's index; `kq_call` the raw entry (type, rows' bytes, x, rows, in, out, ldy, bias, y, threads, accumulate) -> 0,
        -1 out of memory, -2 a type or shape it does not take."""
        self.kq_call = lib.ns_kq_matmul
        self.kq_call.argtypes, self.kq_call.restype = (_i32, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i32,
                                                       _i32), ctypes.c_int
        self._kq_dequant_rows = lib.ns_kq_dequant_rows
        self._kq_dequant_rows.argtypes = (_i32, _ptr, _i64, _i64, _ptr, _i64, _ptr)
        self._kq_dequant_rows.restype = ctypes.c_int
        lib.ns_kq_name.argtypes, lib.ns_kq_name.restype = (_i32,), ctypes.c_char_p
        lib.ns_kq_isa.restype = ctypes.c_char_p
        self.kq_types = {lib.ns_kq_name(i).decode(): i for i in range(lib.ns_kq_types())}
        lib.ns_kq_inputs.argtypes, lib.ns_kq_inputs.restype = (_i32,), _i64
        lib.ns_kq_block_bytes.argtypes, lib.ns_kq_block_bytes.restype = (_i32,), _i64
        # type name -> (inputs per unit, bytes per unit): a row is whole units (256, or 32 for 16-bit rows)
        self.kq_units = {name: (lib.ns_kq_inputs(i), lib.ns_kq_block_bytes(i)) for name, i in self.kq_types.items()}
        self.kq_isa = lib.ns_kq_isa().decode()  # the integer dot product the K-quant kernels were built on
        self._bind_kx16(lib)

    def _bind_kx16(self, lib: ctypes.CDLL) -> None:
        """kx16.c: Q4_K, Q5_K and Q6_K rows 16 outputs interleaved. `kx16_types`: type name -> the library's index;
        `kx16_call` kq_call's arguments with kx16's type index and a packed weight."""
        self.kx16_call = lib.ns_kx16_matmul
        self.kx16_call.argtypes, self.kx16_call.restype = self.kq_call.argtypes, ctypes.c_int
        self._kx16_bytes = lib.ns_kx16_packed_bytes
        self._kx16_bytes.argtypes, self._kx16_bytes.restype = (_i32, _i64, _i64), _i64
        self._kx16_pack, self._kx16_unpack = lib.ns_kx16_pack, lib.ns_kx16_unpack
        for fn in (self._kx16_pack, self._kx16_unpack):
            fn.argtypes, fn.restype = (_i32, _ptr, _i64, _i64, _ptr, _i32), ctypes.c_int
        self._kx16_dequant_rows = lib.ns_kx16_dequant_rows
        self._kx16_dequant_rows.argtypes = (_i32, _ptr, _i64, _i64, _ptr, _i64, _ptr)
        self._kx16_dequant_rows.restype = ctypes.c_int
        lib.ns_kx16_name.argtypes, lib.ns_kx16_name.restype = (_i32,), ctypes.c_char_p
        self.kx16_types = {lib.ns_kx16_name(i).decode(): i for i in range(lib.ns_kx16_types())}
        lib.ns_kx16_isa.restype = ctypes.c_char_p
        self.kx16_isa = lib.ns_kx16_isa().decode()

    def kx16_pack(self, type_name: str, raw: torch.Tensor | list[torch.Tensor], in_features: int) -> torch.Tensor:
        """A file's rows raw [out (in 16s), in / 256 blocks] of a kx16 type, or runs of them stacked along the
        outputs (each in 16s), -> its interleaved weight (Q4_K 148 bytes an output's super-block: the file's 144
        with its scale bytes unpacked; Q5_K 180; Q6_K the file's 210), each run packed in place."""
        parts, kind = [raw] if isinstance(raw, torch.Tensor) else list(raw), self.kx16_types[type_name]
        packed = weight_buffer(self._kx16_bytes(kind, sum(p.shape[0] for p in parts), in_features))
        at = 0
        for part in parts:
            part = part.contiguous()
            if self._kx16_pack(kind, part.data_ptr(), part.shape[0], in_features, packed.data_ptr() + at,
                               torch.get_num_threads()):
                raise ValueError(f"kx16 takes {type_name} rows in 16s of whole super-blocks; this is "
                                 f"{tuple(part.shape)}")
            at += self._kx16_bytes(kind, part.shape[0], in_features)
        return packed

    def kx16_unpack(self, type_name: str, packed: torch.Tensor, out: int, in_features: int) -> torch.Tensor:
        """The file's rows [out, in / 256 * block bytes] back from kx16_pack's weight, bit for bit."""
        width = in_features // 256 * self.kq_units[type_name][1]
        raw = torch.empty(out, width, dtype=torch.uint8)
        self._kx16_unpack(self.kx16_types[type_name], packed.data_ptr(), out, in_features, raw.data_ptr(),
                          torch.get_num_threads())
        return raw

    def kx16_dequant_rows(self, type_name: str, packed: torch.Tensor, out: int, in_features: int,
                          idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` of kx16_pack's weight (out rows), dequantized exactly as gguf does -> [len(idx), in] float32."""
        idx = idx.to(torch.int64).contiguous()
        rows = torch.empty(idx.numel(), in_features)
        done = self._kx16_dequant_rows(self.kx16_types[type_name], packed.data_ptr(), out, in_features,
                                       idx.data_ptr(), idx.numel(), rows.data_ptr())
        if done == -3:
            raise IndexError(f"a row index is outside the {out} rows of the {type_name} table")
        if done:
            raise ValueError(f"cannot dequantize interleaved {type_name} rows of {in_features} inputs")
        return rows

    def kq_matmul(self, type_name: str, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 . W^T -> [rows, out] float32, W the file's K-quant rows `raw` [out, bytes]."""
        rows, k = x.shape
        out = raw.shape[0]
        if x.dtype is not torch.float32 or not x.is_contiguous() or not raw.is_contiguous():
            raise ValueError("the K-quant kernel takes contiguous float32 rows and contiguous blocks")
        y = torch.empty(rows, out)
        done = self.kq_call(self.kq_types[type_name], raw.data_ptr(), x.data_ptr(), rows, k, out, out, None,
                            y.data_ptr(), torch.get_num_threads(), 0) if rows else 0
        if done:
            raise (MemoryError if done == -1 else ValueError)(f"the {type_name} kernel refused {rows} x {k} rows")
        return y

    def kq_dequant_rows(self, type_name: str, raw: torch.Tensor, in_features: int, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` of the file's K-quant rows `raw`, dequantized exactly as gguf does -> [len(idx), in] float32."""
        idx = idx.to(torch.int64).contiguous()
        out = torch.empty(idx.numel(), in_features)
        done = self._kq_dequant_rows(self.kq_types[type_name], raw.data_ptr(), raw.shape[0], in_features,
                                     idx.data_ptr(), idx.numel(), out.data_ptr())
        if done == -3:
            raise IndexError(f"a row index is outside the {raw.shape[0]} rows of the {type_name} table")
        if done:
            raise ValueError(f"cannot dequantize {type_name} rows of {in_features} inputs")
        return out

    def _count(self, name: str, rows: int) -> None:
        self.calls[name] += 1
        self.rows[name] += rows

    def add_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
        """x [rows, n] float32 += delta (when given, in place), then rms_norm(x) * weight in `out_dtype`. The
        weight is the model's (float32, contiguous: checked when the model was put on these kernels)."""
        rows, n = x.shape
        if x.dtype is not torch.float32 or not x.is_contiguous():
            raise ValueError("the fused norm takes a contiguous float32 residual stream")
        kind, at = 0, None
        if delta is not None:
            if delta.shape != x.shape:
                raise ValueError(f"residual {tuple(x.shape)} and delta {tuple(delta.shape)} differ")
            kind, at = _kind(delta), delta.data_ptr()
        out = torch.empty(rows, n, dtype=out_dtype)
        self._add_rms_norm(x.data_ptr(), rows, n, at, kind, weight.data_ptr(), eps, out.data_ptr(), KIND[out_dtype])
        self.calls["norm"] += 1
        self.rows["norm"] += rows
        return out

    def add_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x float32 += delta, in place (the last layer's MLP output into the residual stream)."""
        if x.dtype != torch.float32 or delta.shape != x.shape:
            raise ValueError("the fused add takes a float32 residual and a delta of its shape")
        _kind(x)
        self._add(x.data_ptr(), x.numel(), delta.data_ptr(), _kind(delta))
        self._count("add", x.shape[0])
        return x

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   strides: tuple[int, int], k_block: int = 0) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) dim] -> q [tokens, heads, dim] float32, rotated (after the per-head
        norm when q_norm is given); k (rotated) and v written to one layer's caches at `slots`, whose elements
        sit at slot * strides[0] + head * strides[1] (K's blocks transposed, [dim, k_block], when k_block > 0:
        the heads_kt layout). cos, sin [tokens, dim] and the caches are float32 and
        contiguous (the model's own, checked when it was put on these kernels)."""
        tokens = qkv.shape[0]
        if dim > MAX_HEAD_DIM or qkv.shape[1] != (heads + 2 * kv_heads) * dim:
            raise ValueError(f"qkv {tuple(qkv.shape)} is not {heads} + 2 x {kv_heads} heads of {dim} (at most "
                             f"{MAX_HEAD_DIM})")
        if slots.dtype is not torch.int64 or not slots.is_contiguous() or slots.shape[0] != tokens:
            raise ValueError("slots must be one contiguous int64 per token")
        q = torch.empty(tokens, heads, dim)
        self._rope_store(qkv.data_ptr(), _kind(qkv), tokens, heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(),
                         None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
                         eps, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), *strides, k_block)
        self.calls["rope_store"] += 1
        self.rows["rope_store"] += tokens
        return q

    def attention_scratch(self, group: int, max_keys: int, dim: int, threads: int = 1) -> torch.Tensor:
        """The float32 workspace `attention` needs for queries of at most `max_keys` keys on `threads` threads."""
        return torch.empty(threads * self._attention_scratch(group, max_keys, dim))

    def attention(self, q: torch.Tensor, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, row_of: torch.Tensor, keys_of: torch.Tensor, scale: float,
                  scratch: torch.Tensor, max_keys: int, out_dtype: torch.dtype, threads: int = 1) -> torch.Tensor:
        """Each query of q [tokens, heads, dim] over the keys [0, keys_of[t]) of its table row row_of[t], read
        from one layer's heads_kt caches (k_cache [kv_heads, blocks, dim, block_size], v_cache [kv_heads, blocks,
        block_size, dim]); -> [tokens, heads, dim] in out_dtype. The index tensors and the scratch are the step's
        (FusedInvariantStep), built for at most `max_keys` keys and `threads` threads (which thread computes a
        query changes none of its numbers)."""
        tokens, heads, dim = q.shape
        if q.dtype is not torch.float32 or not q.is_contiguous() or dim > MAX_HEAD_DIM:
            raise ValueError(f"the fused attention takes contiguous float32 queries of at most {MAX_HEAD_DIM} dims")
        _, num_blocks, _, block_size = k_cache.shape
        out = torch.empty(tokens, heads, dim, dtype=out_dtype)
        self._attention(q.data_ptr(), tokens, heads, kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(),
                        num_blocks, block_size, tables.data_ptr(), tables.shape[1], row_of.data_ptr(),
                        keys_of.data_ptr(), scale, scratch.data_ptr(), max_keys, out.data_ptr(), KIND[out_dtype],
                        threads)
        self.calls["attention"] += 1
        self.rows["attention"] += tokens
        return out

    def rescore(self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, shortlist: int) -> torch.Tensor:
        """logits [rows, vocab] float32, in place: each row's `shortlist` highest (a tie to the lower id) recomputed
        as hidden [rows, dim] . weight [vocab, dim] in float32 (nanoserve/model/rescore.py's rule, in one pass)."""
        rows, vocab = logits.shape
        if not 0 < shortlist <= 64 or weight.shape != (vocab, hidden.shape[1]) or hidden.shape[0] != rows:
            raise ValueError(f"cannot rescore {tuple(logits.shape)} logits from hidden {tuple(hidden.shape)} and a "
                             f"{tuple(weight.shape)} head (shortlist {shortlist}, at most 64)")
        for t in (logits, hidden, weight):
            if t.dtype != torch.float32:
                raise ValueError("the fused rescore takes float32 logits, hidden states and head")
            _kind(t)
        self._rescore(logits.data_ptr(), rows, vocab, hidden.data_ptr(), weight.data_ptr(), hidden.shape[1], shortlist)
        self._count("rescore", rows)
        return logits

    def q4_pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """Int4Blocks' codes [out, in] (0..15), scales and zeros [out, in / 32] -> the 4-bit kernel's packed
        weight (kernels/linear.c: 16 outputs by 32 inputs a unit, scales and zeros in float16)."""
        out, k = codes.shape
        if out % 16 or k % 32 or scales.shape != (out, k // 32) or zeros.shape != scales.shape:
            raise ValueError(f"cannot pack a {out}x{k} weight with {tuple(scales.shape)} scales: outputs go in 16s "
                             "and inputs in groups of 32")
        codes = codes.to(torch.uint8).contiguous()
        scales, zeros = scales.float().contiguous(), zeros.float().contiguous()
        packed = weight_buffer(self._q4_bytes(out, k))
        self._q4_pack(codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out, k, packed.data_ptr())
        return packed

    def q4_pack_gguf(self, raw: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
        """A GGUF file's Q4_0 / Q4_1 rows (uint8 [out, in / 32 blocks]) -> the 4-bit kernel's packed weight, the
        same bytes q4_pack makes from the blocks unpacked, with no unpacked copy."""
        _check_gguf_rows(raw, type_name, in_features)
        out, raw = raw.shape[0], raw.contiguous()
        packed = weight_buffer(self._q4_bytes(out, in_features))
        self._q4_pack_gguf(raw.data_ptr(), type_name == "Q4_1", out, in_features, packed.data_ptr(),
                           torch.get_num_threads())
        return packed

    def q4x8_pack_gguf(self, parts: tuple[torch.Tensor, ...], in_features: int) -> torch.Tensor:
        """A GGUF file's Q4_0 rows (runs of them stacked along the outputs, each uint8 [rows, in / 32 blocks of 18
        bytes]) -> q4x8's packed weight (the file's 4.5 bits a weight), each run packed in place."""
        for raw in parts:
            _check_gguf_rows(raw, "Q4_0", in_features)
        packed = weight_buffer(self._q4x8_bytes(sum(p.shape[0] for p in parts), in_features))
        at = 0
        for raw in parts:
            raw = raw.contiguous()
            self._q4x8_pack_gguf(raw.data_ptr(), raw.shape[0], in_features, packed.data_ptr() + at,
                                 torch.get_num_threads())
            at += self._q4x8_bytes(raw.shape[0], in_features)
        return packed

    def q4x8_matmul(self, packed: torch.Tensor, x: torch.Tensor, out: int) -> torch.Tensor:
        """x [rows, in] float32 (contiguous) . W^T -> [rows, out] float32 on q4x8 (8-bit activation codes per 32),
        W packed by q4x8_pack_gguf."""
        rows, k = x.shape
        if x.dtype is not torch.float32 or not x.is_contiguous() or packed.numel() != self._q4x8_bytes(out, k):
            raise ValueError(f"the q4x8 kernel takes contiguous float32 rows of the weight's {k} inputs")
        y = torch.empty(rows, out)
        if rows and self.q4x8_call(packed.data_ptr(), x.data_ptr(), rows, k, out, None, y.data_ptr(),
                                   torch.get_num_threads(), 0):
            raise MemoryError(f"the q4x8 kernel could not allocate the int8 copy of {rows} x {k} activations")
        return y

    def q4_matmul(self, packed: torch.Tensor, x: torch.Tensor, out: int,
                  add_to: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 (contiguous) . W^T -> [rows, out] float32, W packed by q4_pack (added into
        `add_to` when given, which is returned); on torch's thread count (which thread computes an output
        changes none of its bits)."""
        rows, k = x.shape
        if x.dtype is not torch.float32 or not x.is_contiguous() or packed.numel() != self._q4_bytes(out, k):
            raise ValueError(f"the 4-bit kernel takes contiguous float32 rows of the weight's {k} inputs")
        y = torch.empty(rows, out) if add_to is None else add_to
        if y.shape != (rows, out) or y.dtype is not torch.float32 or not y.is_contiguous():
            raise ValueError(f"the 4-bit kernel adds into a contiguous float32 [{rows}, {out}], not {tuple(y.shape)}")
        if rows and self._q4_matmul(packed.data_ptr(), x.data_ptr(), rows, k, out, None, y.data_ptr(),
                                    torch.get_num_threads(), add_to is not None):
            raise MemoryError(f"the 4-bit kernel could not allocate the int8 copy of {rows} x {k} activations")
        return y

    @property
    def q8_vectorized(self) -> bool:
        """Whether the 8-bit kernel has a vector path here (AVX-512 VNNI, AVX2's exact 16-bit products, NEON's
        dot products); in a plain-C build it runs one scalar product at a time and two 4-bit planes on the 4-bit
        kernel are faster."""
        return self.q4_isa in ("avx512-vnni", "avx2", "neon-dotprod")

    def q8_pack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Int8Blocks' codes [out, in] (int8) and scales [out, in / 32] -> the 8-bit kernel's packed weight
        (kernels/linear.c: 16 outputs by 32 inputs a unit, scales in float16: GGUF Q8_0's own)."""
        out, k = codes.shape
        if out % 16 or k % 32 or scales.shape != (out, k // 32):
            raise ValueError(f"cannot pack a {out}x{k} weight with {tuple(scales.shape)} scales: outputs go in 16s "
                             "and inputs in groups of 32")
        codes, scales = codes.to(torch.int8).contiguous(), scales.float().contiguous()
        packed = weight_buffer(self._q8_bytes(out, k))
        self._q8_pack(codes.data_ptr(), scales.data_ptr(), out, k, packed.data_ptr())
        return packed

    def q8_matmul(self, packed: torch.Tensor, x: torch.Tensor, out: int) -> torch.Tensor:
        """q4_matmul for a weight packed by q8_pack."""
        rows, k = x.shape
        if x.dtype is not torch.float32 or not x.is_contiguous() or packed.numel() != self._q8_bytes(out, k):
            raise ValueError(f"the 8-bit kernel takes contiguous float32 rows of the weight's {k} inputs")
        y = torch.empty(rows, out)
        if rows and self._q8_matmul(packed.data_ptr(), x.data_ptr(), rows, k, out, None, y.data_ptr(),
                                    torch.get_num_threads(), 0):
            raise MemoryError(f"the 8-bit kernel could not allocate the int8 copy of {rows} x {k} activations")
        return y

    def use_tiles(self, allowed: bool) -> bool:
        """Let the 4- and 8-bit kernels' calls of 6 rows and more run on AMX (the default where the CPU and the OS
        offer it) or keep them on the vector path; the bits are the same either way. Returns whether the tiles
        can run here."""
        can = bool(self._set_tiles(int(allowed)))
        self._tiles_on = can and allowed
        return can

    @property
    def row_quantum(self) -> int:
        """Rows the 4- and 8-bit kernels compute as one unit in a wide call: a tile's height on the tile unit
        (linear.c pads the last tile with zero rows, so a call of 17 rows costs what one of 32 does), else 1."""
        return TILE_HEIGHT if self._tiles_on else 1

    @property
    def tile_rows(self) -> int:
        """Rows the tile unit has computed in the 4- and 8-bit kernels since the library loaded (counted in C)."""
        return self._tile_rows()

    @property
    def read_ahead_bytes(self) -> int:
        """Bytes of named next weights an idle worker has asked the memory for since the library loaded (counted
        in C, as it asks)."""
        return self._read_ahead_bytes()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's largest value's index, as torch.argmax(dim=-1) (first on a tie, a NaN first of all), for
        contiguous float32 [rows, n]: one pass, no threads to wake."""
        rows, n = x.shape
        if x.dtype is not torch.float32 or not x.is_contiguous() or n == 0:
            return x.argmax(dim=-1)
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax_rows(x.data_ptr(), rows, n, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 n] -> silu(gate) * up [rows, n], in gate_up's dtype."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), _kind(gate_up), rows, width // 2, out.data_ptr())
        self._count("silu_mul", rows)
        return out


def _check_gguf_rows(raw: torch.Tensor, type_name: str, in_features: int) -> None:
    """A GGUF file's Q4_0 / Q4_1 rows as the 4-bit packers take them: uint8 [out in 16s, in / 32 blocks]."""
    width = {"Q4_0": 18, "Q4_1": 20}[type_name]
    out = raw.shape[0]
    if out % 16 or in_features % 32 or raw.shape != (out, in_features // 32 * width) or raw.dtype != torch.uint8:
        raise ValueError(f"cannot pack {tuple(raw.shape)} {type_name} rows of {in_features} inputs: outputs go in "
                         "16s and inputs in blocks of 32")


def load() -> tuple[FusedKernels | None, str]:
    """(the kernels, "") or (None, why they cannot run here)."""
    path, reason = build()
    if path is None:
        return None, reason
    try:
        return FusedKernels(ctypes.CDLL(str(path)), str(path)), ""
    except (OSError, AttributeError) as exc:
        return None, f"loading {path} failed: {exc}"
