"""The prefill-cost model behind the replay's estimated TTFT. Pure arithmetic, no I/O.

A request's time to first token is modelled as the prefill of the tokens it must
compute plus the time to load the tokens the offloading tiers serve, at a stated load
bandwidth per tier (no overlap of loading and compute: conservative for the tiers).
Tokens the device prefix cache serves cost nothing. The saving of a configuration is
its mean TTFT against the ``no-offload`` run of the same trace.

Default model (every number is a command-line option of ``tools/replay.py``):

- Llama-3.1-8B in bf16: 32 layers x 8 KV heads x head dim 128, so its KV cache is
  2 x 32 x 8 x 128 x 2 B = 131,072 B per token (the model's published config.json:
  num_hidden_layers 32, num_key_value_heads 8, hidden_size 4096 / 32 heads).
- on one H100 SXM: 989 TFLOPS dense BF16 (NVIDIA H100 datasheet, 1,979 TFLOPS "with
  sparsity"). Prefill costs about 2 FLOP per parameter per token (8.03 B parameters;
  attention's extra FLOPs ignored at these lengths), so at an ASSUMED 50% model FLOPs
  utilisation: 0.5 x 989e12 / (2 x 8.03e9) = 30,800 tokens/s.
- load bandwidths, ASSUMED until measured on the serving machine: CPU -> GPU 50 GB/s
  (about 80% of PCIe 5.0 x16's 63 GB/s per direction), DISK -> GPU 6 GB/s (one PCIe 4.0
  NVMe drive, about 7 GB/s sequential read on its datasheet).

Loading beats recomputing only above ``break_even_gbps`` = bytes per token x prefill
tokens/s (4.0 GB/s with the defaults): a tier slower than that makes TTFT worse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "Llama-3.1-8B bf16 on 1x H100 SXM"
DEFAULT_PREFILL_TPS = 30_800.0
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_LOAD_GBPS = {"CPU": 50.0, "DISK": 6.0}
SOURCE = (
    "prefill tokens/s = ASSUMED 50% MFU x 989 TFLOPS dense BF16 (NVIDIA H100 SXM datasheet) / "
    "(2 x 8.03e9 FLOP/token); KV bytes/token from Llama-3.1-8B's config.json; "
    "load GB/s ASSUMED (see tools/replay_model.py)"
)


@dataclass(frozen=True)
class PrefillModel:
    """``prefill_tps`` tokens/s of prefill for ``name``; ``kv_bytes_per_token`` of its KV
    cache; ``load_gbps`` per serving tier (``"CPU"``, ``"DISK"``)."""

    name: str = DEFAULT_MODEL
    prefill_tps: float = DEFAULT_PREFILL_TPS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    load_gbps: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LOAD_GBPS))

    def __post_init__(self) -> None:
        if self.prefill_tps <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(
                f"prefill_tps and kv_bytes_per_token must be > 0, got {self.prefill_tps} and {self.kv_bytes_per_token}"
            )
        for tier in ("CPU", "DISK"):
            if self.load_gbps.get(tier, 0) <= 0:
                raise ValueError(f"load_gbps needs a positive {tier} bandwidth, got {self.load_gbps}")

    @property
    def break_even_gbps(self) -> float:
        """Load bandwidth at which loading a token costs as much as computing it."""
        return self.kv_bytes_per_token * self.prefill_tps / 1e9

    def ttft(self, computed_tokens: int, tier_tokens: dict[str, int]) -> float:
        """Seconds to first token: prefill of ``computed_tokens`` plus loading
        ``tier_tokens[tier]`` tokens from each tier."""
        load = sum(n * self.kv_bytes_per_token / (self.load_gbps[tier] * 1e9) for tier, n in tier_tokens.items())
        return computed_tokens / self.prefill_tps + load

    def describe(self) -> str:
        loads = ", ".join(f"{t}->GPU {g:g} GB/s" for t, g in self.load_gbps.items())
        return (
            f"{self.name}: prefill {self.prefill_tps:,.0f} tokens/s, KV {self.kv_bytes_per_token:,} B/token, "
            f"{loads}; loading pays off above {self.break_even_gbps:.1f} GB/s"
        )


def parse_load_gbps(text: str) -> dict[str, float]:
    """``"CPU=50,DISK=6"`` -> ``{"CPU": 50.0, "DISK": 6.0}``; raises ``ValueError`` naming
    the bad part."""
    out = dict(DEFAULT_LOAD_GBPS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        tier, _, value = part.partition("=")
        tier = tier.strip().upper()
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if tier not in out or gbps <= 0:
            raise ValueError(
                f"--load-gbps: bad part {part!r}; expected TIER=GB/s with TIER CPU or DISK "
                f"and a positive number, e.g. CPU=50,DISK=6"
            )
        out[tier] = gbps
    return out
