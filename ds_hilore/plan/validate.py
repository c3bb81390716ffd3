"""Plan validation by leave-one-out timing under joint execution.

NOTE [ Leave-one-out ]
Profiled utilities are measured unit by unit and assumed to add up. Under joint execution they
need not: recomputations overlap, a fast-forward changes what a re-run costs, the allocator and
the caches react to what is kept. When a bucket's plan is first built, its next microbatches
run the plan once untimed (a new plan's first run pays allocations), then the plan itself and,
for every layer the plan does not recompute, the plan with that layer recomputed instead,
interleaved so that drift hits every variant alike, ``repeats`` times each (forward and
backward timed, the optimizer step not). A layer's leave-one-out utility is the fastest time
without its option minus the fastest with the plan (delays from other work only ever add, so
the minimum is the steadiest estimate). A layer whose utility is not positive gains nothing in
practice: it is recomputed from then on and the knapsack runs again without it. Timings are the
max over ranks.

On a shared machine two runs of the same microbatch differ by more than one layer's recompute,
so "not positive" is read against the measurement's own spread: a layer is dropped only when its
utility plus half the mean range of its timings (the plan's and its variant's) is not positive,
and when every round agrees (the variant ran no slower than the plan did in the same round: the
rounds are interleaved, so a round compares runs seconds apart), i.e. when it is shown not to
pay; otherwise the profile's verdict stands. (With two rounds on a shared 2-core CPU, minima
alone sent every layer of a small model to R in one run of six: noise read as "does not pay".) On a CPU the timings
are the process's CPU time, which other tenants' load moves much less than the wall clock.
Pure bookkeeping: the scheduler runs the variants and reads the decision.

NOTE [ Timings per token ]
The microbatches of one bucket have different lengths (anything in (L/2, L]) and, on an uneven
last microbatch, different numbers of sequences, and a microbatch's time grows with its tokens:
timed as they come, a variant that happened to run on shorter microbatches looks faster, and a
layer that pays is dropped (simulated on 28 layers: 5.8 layers per plan). So each timing is
normalised to the bucket's tokens (B x L) before anything compares them: seconds x tokens of
the bucket / tokens of the microbatch. Time is close to linear in tokens for these shapes
(attention's quadratic part is a small share at the lengths one bucket spans); the residue
falls into the spread that the noise rule already reads.
"""

from __future__ import annotations


class LeaveOneOut:
    """The variants still to run and their timings (``None`` = the plan itself)."""

    WARM_UP = "warm-up"  # the plan, untimed
    GC = "gc"  # gradient checkpointing itself: HiLoRe out of the way (NOTE [ Never slower than GC ])

    def __init__(self, layers: list[int], repeats: int, tokens: int | None = None,
                 gc: bool = False):
        """``tokens``: the bucket's (B x L), what every timing is normalised to (NOTE [ Timings
        per token ]); None: timings are compared as recorded. ``gc``: gradient checkpointing
        is timed too, interleaved with the plan."""
        self.tokens, self.repeats = tokens, repeats
        variants: list = [None, *([self.GC] if gc else []), *layers]
        self.queue: list = [self.WARM_UP, *(v for _ in range(repeats) for v in variants)]
        self.times: dict[int | None, list[float]] = {v: [] for v in variants}
        self.current = None
        self.confirming = False  # GC's verdict is being confirmed (``confirm_gc``)

    @property
    def done(self) -> bool:
        return not self.queue

    def next_variant(self):
        """The next variant to run: ``WARM_UP``, ``None`` (the plan) or a layer to recompute."""
        self.current = self.queue.pop(0)
        return self.current

    def record(self, variant, seconds: float, tokens: int | None = None) -> None:
        """The time of one run of ``variant`` on a microbatch of ``tokens`` tokens."""
        if variant == self.WARM_UP:
            return
        if self.tokens and tokens:  # NOTE [ Timings per token ]
            seconds *= self.tokens / tokens
        self.times[variant].append(seconds)

    def flat(self) -> list[float]:
        return [t for v in self.times for t in self.times[v]]

    def set_flat(self, values: list[float]) -> None:
        it = iter(values)
        self.times = {v: [next(it) for _ in ts] for v, ts in self.times.items()}

    def utilities(self) -> dict[int, float]:
        """Seconds each layer's option saves under joint execution (fastest without - with)."""
        base = self._plan_rounds()
        if not base:
            return {}
        with_plan = min(base)
        return {v: min(ts) - with_plan for v, ts in self.times.items()
                if v is not None and v != self.GC and ts}

    def gc_not_slower(self) -> bool:
        """NOTE [ Never slower than GC ]
        A plan saves the recompute of what it keeps, and pays HiLoRe's own costs: its hooks on
        every saved tensor, its bookkeeping per layer, its reads and all-reduces per microbatch.
        Where layers are small or microbatches short, the second can exceed the first, and
        HiLoRe would train slower than the gradient checkpointing it replaces. So where the plan
        is timed against its leave-one-out variants, gradient checkpointing itself (HiLoRe's
        hooks out of the way: ``torch.utils.checkpoint`` on every layer) is timed too,
        interleaved with them; when it ran no slower than the plan in every round (the max over
        ranks, per token), the bucket runs as gradient checkpointing from then on. Every round,
        as for a layer's drop: the rounds are interleaved, so each compares runs seconds apart,
        where the two fastest runs may come from different moments of a shared machine: with
        two rounds, a plan a few percent faster than GC (``make demo``'s, on 2 cores) lost to
        GC's fastest run alone far more often than in both rounds. A bucket whose plan keeps
        nothing runs so without being timed."""
        return self.GC in self.times and self._every_round(self.GC)

    def confirm_gc(self, rounds: int) -> bool:
        """NOTE [ GC's verdict, confirmed ]
        Running a shape as GC gives up every gain the plan would have made on it for the rest of
        the run, on the say of a few microbatches. With two rounds on a 2-core machine whose
        step times move by 10-20 % from one step to the next, a plan measured 7-10 % faster
        than GC step by step was still sent to GC now and then (seen in a 10-step run on
        ``paper-cpu``: the shape ran as GC from step 9). So a first verdict for GC is put to
        ``rounds`` more rounds of the plan against GC alone (the layers' variants have had
        theirs) before it holds: GC must again be no slower in every round, now of twice as
        many. A false verdict needs every one of them to go wrong; a true one costs ``rounds``
        microbatches of the plan. The layers' verdicts still read the plan's runs of their own
        rounds (``_plan_rounds``): a plan timed faster later, against GC alone, would otherwise
        keep a layer its rounds showed not to pay. Once per bucket; True when the rounds were
        queued."""
        if self.confirming or rounds <= 0 or self.GC not in self.times:
            return False
        self.confirming = True
        self.queue += [v for _ in range(rounds) for v in (None, self.GC)]
        return True

    def noise(self, layer: int) -> float:
        """Half the mean range of the plan's and the layer variant's timings (seconds)."""
        spread = [max(ts) - min(ts) for ts in (self._plan_rounds(), self.times[layer]) if ts]
        return sum(spread) / (2 * len(spread)) if spread else 0.0

    def dropped(self) -> set[int]:
        """Layers shown not to pay under joint execution: utility + noise not positive, and in
        every repeat the variant ran no slower than the plan's run of the same round."""
        return {layer for layer, utility in self.utilities().items()
                if utility + self.noise(layer) <= 0 and self._every_round(layer)}

    def _plan_rounds(self) -> list[float]:
        """The plan's timings of the rounds the layers' variants ran in: the rounds that
        confirm GC's verdict time the plan against GC alone, seconds or minutes later, and
        leave the layers' verdicts as they were."""
        return self.times[None][:self.repeats]

    def _every_round(self, variant) -> bool:
        """Every round ran ``variant`` (a layer recomputed, or GC) no slower than the plan."""
        rounds = list(zip(self.times[None], self.times[variant]))
        return bool(rounds) and all(variant <= plan for plan, variant in rounds)
