"""The rows of the benchmark table: which cache setup each one measures."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Row:
    """One configuration to measure.

    key: stable id used by `--modes` and in the JSON.
    label: what the table prints.
    mode: the `enable_kv_offload` mode, or None for the unpatched pipeline.
    call_kwargs: extra pipeline call arguments (`use_kv_cache=False` for the no-cache row).
    config: extra `OffloadConfig` fields (page-cache bypass for the cold file rows, storage).
    fractions: `OffloadConfig` byte fields given as a fraction of one store's cache (`device_budget`,
        `host_budget`), turned into bytes once the cache has been measured (`with_budgets`).
    rerun_of: for a re-run row, the key of the row it repeats: the same mode with prefix reuse on, timed on a
        second request with a new seed (and, for FLUX.2, a new prompt) after an untimed first one.
    """

    key: str
    label: str
    mode: str | None
    call_kwargs: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    fractions: dict = field(default_factory=dict)
    rerun_of: str | None = None

    @property
    def lossy(self) -> bool:
        return self.config.get("storage", "exact") != "exact"

    def with_budgets(self, cache_bytes: int) -> "Row":
        """This row with its fractions as bytes of a cache of `cache_bytes` per store."""
        if not self.fractions:
            return self
        budgets = {name: int(share * cache_bytes) for name, share in self.fractions.items()}
        return replace(self, config={**self.config, **budgets})


ALL_ROWS = (
    Row("none", "no cache", None, call_kwargs={"use_kv_cache": False}),
    Row("gpu_upstream", "gpu, upstream lifetime", None),
    Row("gpu", "gpu, pre-VAE cleanup", "gpu"),
    Row("ram_sync", "ram_sync", "ram_sync"),
    Row("ram_async", "ram_async", "ram_async"),
    Row("file_sync_warm", "file_sync, warm", "file_sync", config={"bypass_page_cache": False}),
    Row("file_async_warm", "file_async, warm", "file_async", config={"bypass_page_cache": False}),
    Row("file_sync_cold", "file_sync, cold", "file_sync", config={"bypass_page_cache": True}),
    Row("file_async_cold", "file_async, cold", "file_async", config={"bypass_page_cache": True}),
    # The dial: part of the cache resident on the device, the rest streamed from RAM; RAM capped, the rest in files.
    Row("device_25", "ram_async, 25% resident", "ram_async", fractions={"device_budget": 0.25}),
    Row("device_50", "ram_async, 50% resident", "ram_async", fractions={"device_budget": 0.50}),
    Row("device_75", "ram_async, 75% resident", "ram_async", fractions={"device_budget": 0.75}),
    Row("host_50", "ram_async, 50% in RAM, rest in files", "ram_async", fractions={"host_budget": 0.50}),
    # Compact storage: half the bytes, a measured error.
    Row("gpu_fp8", "gpu, fp8", "gpu", config={"storage": "fp8"}),
    Row("gpu_int8", "gpu, int8", "gpu", config={"storage": "int8"}),
)
AUTO_ROW = Row("auto", "auto", "auto")
RERUN_ROW = Row("rerun", "re-run, ram_async + reuse", "ram_async", rerun_of="ram_async")
_EXTRA_ROWS = (AUTO_ROW, RERUN_ROW)  # selected by name only
BASELINE_KEY = "gpu_upstream"
# The default run: the rows the recommendation chooses between (every place, the dial's two kinds of budget, and
# no cache), small enough that the table prints within two minutes on two cores. `--modes all`: every row.
VERDICT_KEYS = ("none", "gpu", "ram_async", "file_async_cold", "device_50", "host_50")

# Shorthands accepted by --modes besides the row keys: a mode name selects all its rows.
_ALIASES = {
    "off": ("none",),
    "no_cache": ("none",),
    "file_sync": ("file_sync_warm", "file_sync_cold"),
    "file_async": ("file_async_warm", "file_async_cold"),
    "warm": ("file_sync_warm", "file_async_warm"),
    "cold": ("file_sync_cold", "file_async_cold"),
    "dial": ("device_25", "device_50", "device_75", "host_50"),
    "lossy": ("gpu_fp8", "gpu_int8"),
    "reuse": ("ram_async", "rerun"),
}


def select_rows(spec: str | None) -> list[Row]:
    """Rows named by a comma-separated `--modes` value (None: the verdict's rows; "all": every row), in table order."""
    if spec is None:
        return [row for row in ALL_ROWS if row.key in VERDICT_KEYS]
    if spec.strip() == "all":
        return list(ALL_ROWS)
    by_key = {row.key: row for row in (*ALL_ROWS, *_EXTRA_ROWS)}
    wanted: set[str] = set()
    for name in (part.strip() for part in spec.split(",")):
        if not name:
            continue
        keys = _ALIASES.get(name, (name,))
        unknown = [k for k in keys if k not in by_key]
        if unknown:
            choices = ", ".join([*by_key, *_ALIASES])
            raise ValueError(f"`--modes`: unknown row {name!r}. Choose from: {choices} (comma-separated), or 'all'.")
        wanted.update(keys)
    return [row for row in (*ALL_ROWS, *_EXTRA_ROWS) if row.key in wanted]
