"""Which ranks of a sending stage feed which ranks of a receiving stage.

Two stages of a pipeline may shard the same tensors over different numbers of ranks along
one parallel dimension (tensor parallel heads, sequence parallel tokens, ring attention
chunks). Routing is lossless only when the larger size is a multiple of the smaller: then
each rank of the larger side pairs with exactly one rank of the smaller side, and a rank of
the smaller side covers `ratio` consecutive ranks of the larger one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrdma.errors import ConfigError

DIMENSIONS = ("tp", "sp", "ring")


@dataclass(frozen=True)
class StageMapping:
    """The rank mapping between a sending and a receiving stage along one dimension."""

    sender_size: int
    receiver_size: int
    dimension: str = "tp"

    def __post_init__(self) -> None:
        if self.dimension not in DIMENSIONS:
            raise ConfigError(
                f"dimension: expected one of {', '.join(DIMENSIONS)}, got {self.dimension!r}"
            )
        for name in ("sender_size", "receiver_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        big, small = self._sizes()
        if big % small:
            raise ConfigError(
                f"{self.dimension} sizes {self.sender_size} (sender) and {self.receiver_size} "
                f"(receiver) cannot be routed losslessly: {big} is not a multiple of {small}"
            )

    def _sizes(self) -> tuple[int, int]:
        return max(self.sender_size, self.receiver_size), min(self.sender_size, self.receiver_size)

    @property
    def ratio(self) -> int:
        """Larger size over smaller size (1 when both stages match)."""
        big, small = self._sizes()
        return big // small

    @property
    def heterogeneous(self) -> bool:
        return self.sender_size != self.receiver_size

    @property
    def splits(self) -> bool:
        """True when a sender's shard is cut into pieces for several receivers."""
        return self.receiver_size > self.sender_size

    def sources(self, receiver_rank: int) -> list[int]:
        """Sender ranks the receiver rank gets shards from, in merge order."""
        self._check_rank("receiver_rank", receiver_rank, self.receiver_size)
        if self.splits:
            return [receiver_rank // self.ratio]
        return list(range(receiver_rank * self.ratio, (receiver_rank + 1) * self.ratio))

    def targets(self, sender_rank: int) -> list[int]:
        """Receiver ranks the sender rank sends to, in slice order."""
        self._check_rank("sender_rank", sender_rank, self.sender_size)
        if self.splits:
            return list(range(sender_rank * self.ratio, (sender_rank + 1) * self.ratio))
        return [sender_rank // self.ratio]

    def piece(self, receiver_rank: int) -> tuple[int, int]:
        """(index, count): which of `count` equal pieces of its sender's shard this receiver
        rank takes; (0, 1) when it takes whole shards."""
        self._check_rank("receiver_rank", receiver_rank, self.receiver_size)
        if self.splits:
            return receiver_rank % self.ratio, self.ratio
        return 0, 1

    def validate(self, extent: int, *, what: str = "heads") -> None:
        """Check that a dimension of `extent` (total over all ranks) shards evenly on both
        stages, so slicing and merging lose nothing."""
        for side, size in (("sender", self.sender_size), ("receiver", self.receiver_size)):
            if extent % size:
                raise ConfigError(
                    f"{extent} {what} cannot be sharded over {size} {side} ranks "
                    f"({self.dimension}): {extent} is not a multiple of {size}"
                )

    @staticmethod
    def _check_rank(name: str, rank: int, size: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ConfigError(f"{name}: expected an integer in [0, {size}), got {rank!r}")
