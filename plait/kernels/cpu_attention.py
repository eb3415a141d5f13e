"""Fast torch attention over the KV pool for the CPU (the `torch` backend's kernels).

`plait.kernels.torch_backend` keeps the plain references that every kernel is tested against;
these are the paths the CPU actually runs:

* extend: one fused `scaled_dot_product_attention` per request on 4-D views with
  `enable_gqa` (no repeated K/V copies), `is_causal` when nothing is cached (the flash kernel,
  no mask), an explicit mask only when the request has a cached prefix.
* decode, "cascade": requests whose KV starts with the same pool slots (a radix-cache hit on a
  shared rubric, system prompt or tree root) are grouped once per forward; each group's shared
  prefix is read from the pool once and attended by all its queries as one matrix product,
  and only each request's own suffix is gathered into a padded batch. The two partial results
  are merged with their log-sum-exps. Without sharing this is a padded gather of every
  request's KV, as before, done with one `index_select`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.kernels.base import AttentionMetadata

# a shared prefix shorter than this is attended with the rest (the grouping costs more)
MIN_SHARED_PREFIX = 32


def extend_attention_cpu(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]; K/V read from the pool (already holding the new tokens)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_buffer.shape[1]
    rows = meta.req_to_token[meta.req_pool_indices]  # [B, C]
    start = 0
    for i in range(meta.batch_size):
        ext, seq, pre = meta.extend_lens_cpu[i], meta.seq_lens_cpu[i], meta.prefix_lens_cpu[i]
        if ext == 0:
            continue
        slots = rows[i, :seq].long()
        k = k_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
        qi = q[start : start + ext].transpose(0, 1)[None]  # [1, H, E, D]
        if pre == 0:  # square: the top-left causal mask is the right one
            o = F.scaled_dot_product_attention(
                qi, k, v, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:  # row r sits at position pre + r and sees keys 0..pre + r
            mask = torch.ones(ext, seq, dtype=torch.bool, device=q.device).tril_(pre)
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
        out[start : start + ext] = o[0].transpose(0, 1)
        start += ext
    return out


@dataclass
class PrefixGroup:
    members: torch.Tensor  # [n] int64, batch rows sharing the prefix
    slots: torch.Tensor  # [P] int64, the shared prefix's pool slots


@dataclass
class DecodePlan:
    groups: list[PrefixGroup]
    suffix_slots: torch.Tensor  # [B, Ls] int64, each request's KV after its group's prefix
    suffix_valid: torch.Tensor  # [B, Ls] bool

    @property
    def shared_tokens(self) -> int:
        """KV rows read once per group instead of once per member (for the stats)."""
        return sum(int(g.slots.numel()) * (int(g.members.numel()) - 1) for g in self.groups)


def plan_decode(meta: AttentionMetadata, min_shared: int = MIN_SHARED_PREFIX) -> DecodePlan:
    """Group the batch by shared KV prefix (same pool slots) and index each request's suffix."""
    cached = meta.cache.get("cpu_decode_plan")
    if cached is not None:
        return cached
    device = meta.req_to_token.device
    seq_lens = meta.seq_lens_cpu
    bsz = meta.batch_size
    rows = meta.req_to_token[meta.req_pool_indices, : meta.max_seq_len]  # [B, L] int32
    prefix = [0] * bsz
    groups: list[PrefixGroup] = []
    by_first: dict[int, list[int]] = {}
    if bsz > 1 and meta.max_seq_len > min_shared:
        for b, first in enumerate(rows[:, 0].tolist()):
            by_first.setdefault(first, []).append(b)
    for members in by_first.values():
        # the prefix stops before every member's last token (its own, new this step)
        limit = min(seq_lens[b] for b in members) - 1
        if len(members) < 2 or limit < min_shared:
            continue
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        sub = rows[idx, :limit]
        same = (sub == sub[:1]).all(dim=0)  # [limit]
        shared = limit if bool(same.all()) else int((~same).int().argmax())
        if shared < min_shared:
            continue
        groups.append(PrefixGroup(idx, sub[0, :shared].long()))
        for b in members:
            prefix[b] = shared
    suffix_lens = [s - p for s, p in zip(seq_lens, prefix)]
    width = max(suffix_lens, default=0)
    offsets = torch.tensor(prefix, dtype=torch.int64, device=device)
    pos = torch.arange(width, device=device)[None, :]
    valid = pos < torch.tensor(suffix_lens, device=device)[:, None]
    cols = (offsets[:, None] + pos).clamp_(max=max(rows.shape[1] - 1, 0))
    slots = torch.where(valid, rows.gather(1, cols).long(), 0)
    plan = DecodePlan(groups, slots, valid)
    meta.cache["cpu_decode_plan"] = plan
    return plan


def decode_attention_cpu(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
) -> torch.Tensor:
    """q: [B, H, D] (one token per request) -> [B, H, D]."""
    plan = plan_decode(meta)
    bsz, num_heads, head_dim = q.shape
    num_kv = k_buffer.shape[1]
    group = num_heads // num_kv
    qg = q.view(bsz, num_kv, group, head_dim)
    out, lse = _padded_attention(
        qg, k_buffer, v_buffer, plan.suffix_slots, plan.suffix_valid, scaling, bool(plan.groups)
    )
    for g in plan.groups:
        n = g.members.numel()
        # [n, Hkv, G, D] -> [Hkv, n*G, D]: every member's query heads against one K/V read
        qs = qg.index_select(0, g.members).permute(1, 0, 2, 3).reshape(num_kv, n * group, head_dim)
        k = k_buffer.index_select(0, g.slots).to(q.dtype).permute(1, 2, 0)  # [Hkv, D, P]
        v = v_buffer.index_select(0, g.slots).to(q.dtype).transpose(0, 1)  # [Hkv, P, D]
        scores = torch.bmm(qs, k).float() * scaling  # [Hkv, nG, P]
        p_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, nG]
        p_out = torch.bmm(torch.exp(scores - p_lse[..., None]).to(q.dtype), v)  # [Hkv, nG, D]
        p_out = p_out.view(num_kv, n, group, head_dim).permute(1, 0, 2, 3)  # [n, Hkv, G, D]
        p_lse = p_lse.view(num_kv, n, group).permute(1, 0, 2)  # [n, Hkv, G]
        s_out, s_lse = out[g.members], lse[g.members]
        new_lse = torch.logaddexp(p_lse, s_lse)
        merged = (
            p_out.float() * torch.exp(p_lse - new_lse)[..., None]
            + s_out.float() * torch.exp(s_lse - new_lse)[..., None]
        )
        out[g.members] = merged.to(out.dtype)
    return out.reshape(bsz, num_heads, head_dim)


def _padded_attention(qg, k_buffer, v_buffer, slots, valid, scaling, want_lse: bool):
    """Attention of qg [B, Hkv, G, D] over K/V at slots [B, L] (valid: [B, L]).

    Returns out [B, Hkv, G, D] and, if asked, the log-sum-exp [B, Hkv, G] (float32)."""
    bsz, num_kv, group, head_dim = qg.shape
    width = slots.shape[1]
    flat = slots.reshape(-1)
    k = k_buffer.index_select(0, flat).view(bsz, width, num_kv, head_dim).to(qg.dtype)
    v = v_buffer.index_select(0, flat).view(bsz, width, num_kv, head_dim).to(qg.dtype)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scaling  # [B, Hkv, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    if want_lse:
        lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
        probs = torch.exp(scores - lse[..., None])
    else:
        lse = None
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(qg.dtype), v.permute(0, 2, 1, 3))  # [B, Hkv, G, D]
    return out, lse
