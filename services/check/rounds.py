"""What the rounds of a check measured and reported, added up as they ran: the fabric
phase's and the job phase's alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ringwatch.agents import profiles
from ringwatch.agents.spec import Finding, GroupSpec, Measurement, RoundResult

# Where a check says what it runs, a line at a time (each round's groups).
Progress = Callable[[str], None]


@dataclass
class Rounds:
    """What rounds of groups measured and reported, added up as they ran."""

    measurements: list[Measurement] = field(default_factory=list)
    probe_findings: list[Finding] = field(default_factory=list)
    rounds: int = 0
    fabric_s: float = 0.0
    wall_s: float = 0.0
    # Seconds each rank spent inside probe groups.
    busy_s: dict[str, float] = field(default_factory=dict)

    def take(self, groups: Sequence[GroupSpec], result: RoundResult,
             node_profiles: dict[str, str | None]) -> None:
        """Add one round's result (its measurements annotated with their nodes' rated
        busbw, agents.profiles)."""
        self.rounds += 1
        self.fabric_s += result.fabric_time_s
        for g in groups:
            for m in g.members:
                self.busy_s[m] = self.busy_s.get(m, 0.0) + result.busy_s.get(m, result.wall_time_s)
        profiles.annotate(result.measurements, node_profiles)
        self.measurements += result.measurements
        self.probe_findings += result.findings

    def absorb(self, other: Rounds) -> None:
        """Count ``other``'s rounds (another phase of the same check) as this one's."""
        self.rounds += other.rounds
        self.fabric_s += other.fabric_s
        self.measurements += other.measurements
        self.probe_findings += other.probe_findings
        for m, seconds in other.busy_s.items():
            self.busy_s[m] = self.busy_s.get(m, 0.0) + seconds
