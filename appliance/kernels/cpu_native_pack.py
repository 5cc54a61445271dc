"""The native kernels' weight layouts: a linear's weight packed in panels of
``PANEL`` output channels as ``cpu_ops.c`` reads it (fp32/bf16/int8 as
stored, W8A8's and the int8 rows' k quads, int4 nibble pairs, and the
grouped formats' scales and mins beside them). Pure torch: ``NativeLinear``
(``cpu_native_ops``) picks the layout and the tests build panels with
these."""

from __future__ import annotations

import torch

PANEL = 16  # output channels per packed panel (PW in cpu_ops.c)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / 16), k, 16]: each panel holds 16 output channels with
    the channels of one k contiguous; rows past n are zero."""
    n, k = w.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=w.dtype)
    padded[:n] = w
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def pack_vnni_panels(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [n, k] -> (int8 [ceil(n / 16), ceil(k / 4), 16, 4]: the
    channels of a panel as k quads, the operand layout of vpdpbusd; k and n
    zero-padded; int32 [ceil(n / 16) * 16] each channel's sum of weights,
    which the kernel subtracts 128 times for its unsigned rows)."""
    n, k = q.shape
    panels, quads = -(-n // PANEL), -(-k // 4)
    padded = torch.zeros(panels * PANEL, quads * 4, dtype=torch.int8)
    padded[:n, :k] = q
    packed = padded.view(panels, PANEL, quads, 4).transpose(1, 2).contiguous()
    return packed, padded.to(torch.int32).sum(dim=1, dtype=torch.int32)


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [n, k] (k a multiple of 4) -> uint8 [ceil(n / 16), k / 4,
    16, 4]: ``pack_vnni_panels``' quads plus 128 (the unsigned operand of
    vpdpbusd), channels past n zero (128)."""
    if q.shape[1] % 4:
        raise ValueError(f"int8 quads need in_features a multiple of 4, not {q.shape[1]}")
    return (pack_vnni_panels(q)[0].view(torch.uint8) ^ 0x80).contiguous()


def pack_q4_panels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values q (uint8 [n, k], 0..15) with group scales d and mins m
    ([n, k / group], both fp16 or both fp32) -> (``pack_q4_pairs(q)``;
    qparams in d's dtype [ceil(n / 16), k / group, 2, 16]: each group's 16
    scales, then 16 mins)."""
    return pack_q4_pairs(q), pack_group_params(d, m)


def _padded_q4(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    qp = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.uint8)
    qp[:n] = q
    return qp


def pack_q4_pairs(q: torch.Tensor) -> torch.Tensor:
    """int4 values q (uint8 [n, k], 0..15) -> bytes [ceil(n / 16), k / 2, 16]:
    channel c of k pair j in byte c of row j, k = 2j in its low nibble.
    Channels past n are zero."""
    k = q.shape[1]
    pairs = _padded_q4(q).view(-1, PANEL, k // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()


def pack_q4_quads(q: torch.Tensor) -> torch.Tensor:
    """int4 values q (uint8 [n, k], 0..15; k a multiple of 8) -> bytes
    [ceil(n / 16), k / 8, 16, 4], the int8 rows' quads two to a byte: byte i
    of channel c in row j holds k = 8j + i in its low nibble and 8j + 4 + i
    in its high one (a row's 64 bytes are two of vpdpbusd's operands, one
    mask and one shift apart). Channels past n are zero."""
    k = q.shape[1]
    if k % 8:
        raise ValueError(f"int4 quads need in_features a multiple of 8, not {k}")
    halves = _padded_q4(q).view(-1, PANEL, k // 8, 2, 4)
    return (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).transpose(1, 2).contiguous()


def pack_group_params(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Group scales d and mins m [n, groups] -> [ceil(n / 16), groups, 2, 16]
    in their dtype: each group's 16 scales, then its 16 mins (zero past n)."""
    n, groups = d.shape
    panels = -(-n // PANEL)
    params = torch.zeros(2, panels * PANEL, groups, dtype=d.dtype)
    params[0, :n], params[1, :n] = d, m
    return params.view(2, panels, PANEL, groups).permute(1, 3, 0, 2).contiguous()
