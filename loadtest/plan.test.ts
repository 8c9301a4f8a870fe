import { describe, expect, it } from 'vitest';
import { bookChild, crossHostExtraMs, fetchExtraMs, fewestHosts, formatPlan, modelFrom, pickTemplate, planCapacity, searchHosts, simulate } from './plan.ts';
import type { LatencyModel, PlanOptions, SimHost, SimOutcome } from './plan.ts';
import type { RunResult } from './report.ts';

const run: RunResult = {
  env: { accel: 'tcg', hosts: 3, link_gbps: 10, guest_mib: 256, dirty_mib: 64, date: '', git_commit: '', api: '', mode: 'quick', notes: [] },
  scenarios: {
    fork_same_host_1: { n: 3, p50_ms: 200, p95_ms: 260, p99_ms: 260, max_ms: 260 },
    fork_cross_host_1: { n: 3, p50_ms: 300, p95_ms: 380, p99_ms: 380, max_ms: 380 },
  },
  samples: { fork_same_host_1: [180, 200, 260], fork_cross_host_1: [280, 300, 380] },
};

describe('capacity planner', () => {
  it('modelFrom_takesTransferAsCrossMinusSameP50', () => {
    const m = modelFrom(run);
    expect(m.transferMsAtRun).toBe(100);
    expect(m.sameHostMs).toEqual([180, 200, 260]);
  });

  it('modelFrom_aFailedOrStoppedScenario_isNoData_andAPlanWithoutCrossHostDataIsRefused', () => {
    // Taken as free, a cross-host fork would make the plan optimistic.
    expect(() => modelFrom({ ...run, scenarios: { ...run.scenarios, fork_cross_host_1: { ...(run.scenarios.fork_cross_host_1 as object), failed: 'x' } as never } })).toThrow(/no complete fork_cross_host_1 \(it failed: x\)/);
    expect(() => modelFrom({ ...run, scenarios: { ...run.scenarios, fork_cross_host_1: { ...(run.scenarios.fork_cross_host_1 as object), truncated: '1 of 5 samples' } as never } })).toThrow(/stopped early: 1 of 5/);
    expect(() => modelFrom({ ...run, scenarios: { fork_same_host_1: run.scenarios.fork_same_host_1! } })).toThrow(/no complete fork_cross_host_1 \(no samples\)/);
    expect(() => modelFrom({ ...run, scenarios: { ...run.scenarios, fork_same_host_1: { ...(run.scenarios.fork_same_host_1 as object), failed: 'boom' } as never } })).toThrow(/it failed: boom/);
  });

  it('simulate_scalesOnlyTheWireTimeOfACrossHostFork_withTheLinkRate', () => {
    // 1 second more than same host at 10 Gbit/s, of which 125 MB moved: 100 ms on the wire.
    const withBytes: RunResult = {
      ...run,
      scenarios: { ...run.scenarios, fork_cross_host_1: { n: 3, p50_ms: 1200, p95_ms: 1300, p99_ms: 1300, max_ms: 1300 } },
      phases: { fork_cross_host_1: { n: 3, op_ms: 0, to_first_step_ms: 0, host_step_ms: 0, step_overhead_ms: 0, exec_after_op_ms: 0, bytes_moved: 125e6, migrated_samples: 3 } },
    };
    const m = modelFrom(withBytes);
    expect([m.transferMsAtRun, m.wireMsAtRun]).toEqual([1000, 100]);
    expect(crossHostExtraMs(m, 10)).toBe(1000);
    expect(crossHostExtraMs(m, 1)).toBe(900 + 1000);
    expect(crossHostExtraMs(m, 100)).toBeCloseTo(900 + 10, 6);
    // A run without bytes moved: all of it scales, as before.
    expect(crossHostExtraMs(modelFrom(run), 1)).toBe(1000);
  });

  it('modelFrom_aScenarioWithoutSamples_isNoData_notAZeroMsFork', () => {
    const none = { n: 0 as const, p50_ms: null, p95_ms: null, p99_ms: null, max_ms: null, failed: 'exec timed out' };
    expect(() => modelFrom({ ...run, schema_version: 2, scenarios: { ...run.scenarios, fork_cross_host_1: none } })).toThrow(/no complete fork_cross_host_1 \(it failed: exec timed out\)/);
    expect(() => modelFrom({ ...run, schema_version: 3 })).toThrow(/schema_version 3 is newer/);
  });

  it('modelFrom_aRunWithAnUnknownLinkRate_throws', () => {
    expect(() => modelFrom({ ...run, env: { ...run.env, link_gbps: null } })).toThrow(/link rate is unknown/);
  });

  it('modelFrom_withoutSameHostSamples_throws', () => {
    expect(() => modelFrom({ ...run, scenarios: {} })).toThrow(/fork_same_host_1/);
  });

  it('simulate_isDeterministicForASeed', () => {
    const o = { forksPerSecond: 50, p95TargetMs: 1000, simulatedSeconds: 5, seed: 3 };
    expect(simulate(modelFrom(run), 64, 10, o)).toEqual(simulate(modelFrom(run), 64, 10, o));
  });

  it('simulate_withTooFewHosts_queuesAndMissesWhereMoreHostsMeetTheTarget', () => {
    const o = { forksPerSecond: 40, p95TargetMs: 400, simulatedSeconds: 3, slotsPerHost: 1, templates: 5 };
    const few = simulate(modelFrom(run), 4, 10, o);
    const many = simulate(modelFrom(run), 64, 10, o);
    expect(few.p95Ms).toBeGreaterThan(many.p95Ms);
    expect(many.p95Ms).toBeLessThanOrEqual(400);
  });

  it('planCapacity_findsTheFewestHostsThatMeetTheTarget_andSlowLinksNeedNoFewer', () => {
    const plan = planCapacity(run, { forksPerSecond: 20, p95TargetMs: 450, simulatedSeconds: 3, slotsPerHost: 1, templates: 5, linkRatesGbps: [1, 10], maxHosts: 256 });
    const [g1, g10] = plan.answers;
    expect(g10?.hosts).not.toBeNull();
    expect(g10!.outcome!.p95Ms).toBeLessThanOrEqual(450);
    // One host fewer must miss the target (minimality).
    const fewer = simulate(plan.model, g10!.hosts! - 1, 10, plan.request);
    expect(fewer.p95Ms > 450 || fewer.unplaced > 0).toBe(true);
    if (g1?.hosts != null) expect(g1.hosts).toBeGreaterThanOrEqual(g10!.hosts!);
  });

  it('simulate_childrenOnAHostStillFetching_waitForTheFetch', () => {
    // Two templates, each on one host at first, 16 children a fork, 100 ms restores, 2 s copies.
    const model: LatencyModel = { sameHostMs: [100], transferMsAtRun: 2000, wireMsAtRun: 2000, runLinkGbps: 10, runAccel: 'tcg', runDate: '', runGitCommit: '', guestMib: 256, source: 'test' };
    // Measured from the start (later on every host holds both), with the 8 slots it was written for.
    const s = simulate(model, 16, 10, { forksPerSecond: 5, childrenPerFork: 16, slotsPerHost: 8, templates: 2, simulatedSeconds: 20, warmUpSeconds: 0, p95TargetMs: 1e9 });
    // When place() sends a copy to a host it puts several of the fork's children there, and each
    // waits for the whole copy plus its restore: here more than 5% of children (9%) do. Before,
    // only the first waited, the rest took a restore, and the host was a holder from the next
    // view on: p95 was 1780 ms, below what a copy takes.
    expect(s.p95Ms).toBeGreaterThanOrEqual(crossHostExtraMs(model, 10) + Math.min(...model.sameHostMs));
    expect(s.crossHostFraction).toBeGreaterThan(0.05);
  });

  it('bookChild_childrenOnAHostStillFetching_startNoEarlierThanTheCopy', () => {
    const host: SimHost = { slotFree: [0, 0, 0, 0], copyAt: new Map() };
    // The first child fetches the snapshot (2 s) in its slot; the second, of the same fork, has
    // a free slot but waits for that copy; so does a child of a fork placed while it is coming.
    expect(bookChild(host, 'tpl-0', 0, 100, 2000)).toEqual({ readyAtMs: 2100, onTransfer: true });
    expect(bookChild(host, 'tpl-0', 0, 100, 2000)).toEqual({ readyAtMs: 2100, onTransfer: true });
    expect(bookChild(host, 'tpl-0', 500, 100, 2000)).toEqual({ readyAtMs: 2100, onTransfer: true });
    // Once the copy is complete a child only restores.
    expect(bookChild(host, 'tpl-0', 3000, 100, 2000)).toEqual({ readyAtMs: 3100, onTransfer: false });
    expect(bookChild({ slotFree: [0], copyAt: new Map([['tpl-0', 0]]) }, 'tpl-0', 10, 100, 2000)).toEqual({ readyAtMs: 110, onTransfer: false });
  });

  it('simulate_sameOptions_sameArrivalsForEveryHostCount', () => {
    const o = { forksPerSecond: 50, p95TargetMs: 1000, simulatedSeconds: 2, childrenPerFork: 3, templates: 5 };
    const m = modelFrom(run);
    const asked = [1, 3, 16, 64].map((h) => simulate(m, h, 10, o)).map((s) => s.children + s.unplaced);
    expect(new Set(asked).size).toBe(1);
    const slowLink = simulate(m, 16, 1, o);
    expect(slowLink.children + slowLink.unplaced).toBe(asked[0]);
  });

  it('planCapacity_answersTheFewestHostsFromWhichMoreHostsMeetTheTargetToo', () => {
    // Each fleet size used to get its own arrivals: here 6 hosts met the target by luck
    // (p95 360 ms), 7 missed it (519 ms) and 5 too, and the search answered 6.
    const o = { forksPerSecond: 20, p95TargetMs: 450, simulatedSeconds: 3, slotsPerHost: 1, templates: 5, linkRatesGbps: [10], maxHosts: 64 };
    const plan = planCapacity(run, o);
    const meets = (h: number): boolean => {
      const s = simulate(plan.model, h, 10, o);
      return s.unplaced === 0 && s.p95Ms <= o.p95TargetMs;
    };
    // The fewest hosts from which every count up to 24 meets the target: 5 now (p95 481 ms at 4).
    const upTo = 24;
    let fewest = upTo + 1;
    while (fewest > 1 && meets(fewest - 1)) fewest--;
    expect(plan.answers[0]?.hosts).toBe(fewest);
  });

  it('fewestHosts_anAnswerThatOneHostMoreMisses_isAFluke_andTheSearchGoesOnAboveTheMiss', () => {
    // Meets the target at 6 and from 8 on, misses at 7: bisection alone answers 6.
    const out = (hosts: number): SimOutcome => ({ hosts, linkGbps: 10, children: 1, p50Ms: 1, p95Ms: 1, crossHostFraction: 0, unplaced: 0 });
    const tried: number[] = [];
    const ok = (h: number): SimOutcome | null => (tried.push(h), h === 6 || h >= 8 ? out(h) : null);
    expect(fewestHosts(ok, 64)?.hosts).toBe(8);
    expect(tried).toContain(7);
    // Monotone: the answer as before, confirmed by one host more.
    expect(fewestHosts((h) => (h >= 11 ? out(h) : null), 64)?.hosts).toBe(11);
    expect(fewestHosts(() => null, 64)).toBeNull();
    expect(fewestHosts((h) => (h === 64 ? out(h) : null), 64)?.hosts).toBe(64);
  });

  it('searchHosts_aSizeThatPassed_isNotOverriddenByTheStop_andTheConfirmIsSimulated', () => {
    // One template (the stop applies from 8 hosts): 16 passes, 17 misses (a fluke), 36 passes.
    // Bisecting to 36 tries 34, which misses as 17 did: the stop ended the search there and
    // vetoed 35 and the confirm 37 unsimulated, answering none though 36 passed.
    const sim: number[] = [];
    const out = (hosts: number): SimOutcome => (sim.push(hosts), { hosts, linkGbps: 1, children: 1000, p50Ms: 500, p95Ms: hosts === 16 || hosts >= 36 ? 1499 : 1510, crossHostFraction: 0, unplaced: 0 });
    const a = searchHosts(out, 1500, 64, 8);
    expect(a.hosts).toBe(36);
    expect(a.noBetterFrom).toBeUndefined();
    expect(sim).toContain(37);
    // Where 37 and 38 miss too (36 a fluke), the search doubles on above them: a stop set at 34
    // (no better than 17, though 36 passed) ended it there.
    expect(searchHosts((hosts) => ({ ...out(hosts), p95Ms: hosts === 16 || hosts === 36 || hosts >= 76 ? 1499 : 1510 }), 1500, 128, 8).hosts).toBe(76);
  });

  it('searchHosts_p95FallingEnoughPerDoublingToReachTheTarget_searchesOn_andStopsOnlyWhereItCannot', () => {
    const at = (p95: (h: number) => number, maxHosts = 64): { a: ReturnType<typeof searchHosts>; sim: number[] } => {
      const sim: number[] = [];
      const a = searchHosts((hosts) => (sim.push(hosts), { hosts, linkGbps: 1, children: 1000, p50Ms: 500, p95Ms: p95(hosts), crossHostFraction: 0, unplaced: 0 }), 1500, maxHosts, 8);
      return { a, sim };
    };
    // 1520 ms at 8 hosts, 1510 at 16, 1501 at 32: each within 1% of the half, which stopped the
    // search at "> 16", though 10 ms a doubling closes the 10 ms left by 64 hosts; 40 meet it.
    expect(at((h) => (h >= 40 ? 1499 : h >= 32 ? 1501 : h >= 16 ? 1510 : 1520)).a.hosts).toBe(40);
    // No better over a doubling (16 to 32): stops, and 64 is not simulated.
    const flat = at((h) => (h >= 64 ? 1499 : h >= 16 ? 1510 : 1600));
    expect([flat.a.hosts, flat.a.noBetterFrom?.hosts, flat.sim.includes(64)]).toEqual([null, 16, false]);
    // Better by 20 ms a doubling, 80 ms above the target: one more doubling (to 64) cannot close it.
    const slow = at((h) => (h >= 64 ? 1499 : h >= 32 ? 1580 : h >= 16 ? 1600 : 1700));
    expect([slow.a.hosts, slow.a.noBetterFrom?.hosts, slow.sim.includes(64)]).toEqual([null, 16, false]);
    // The plan says which: "no better" only where p95 did not fall.
    const said = (a: ReturnType<typeof searchHosts>): string => formatPlan({ request: { forksPerSecond: 1, p95TargetMs: 1500, maxHosts: 64 }, model: modelFrom(run), answers: [{ linkGbps: 1, ...a }] });
    expect(said(flat.a)).toMatch(/1 Gbit\/s: 32 hosts missed no better than 16 \(p95 1510 ms, 1510 ms at 16\); larger fleets were not simulated/);
    expect(said(slow.a)).toMatch(/1 Gbit\/s: p95 fell only from 1600 ms at 16 hosts to 1580 ms at 32: at that rate a doubling it would still miss 1500 ms at 64 hosts/);
    expect(said(slow.a)).not.toMatch(/no better/);
    // The same with up to 8192 hosts: 8 doublings more could.
    expect(at((h) => (h >= 64 ? 1499 : h >= 32 ? 1580 : h >= 16 ? 1600 : 1700), 8192).a.hosts).toBe(64);
    // A miss at maxHosts itself leaves nothing unsimulated: no stop, and the plan says nothing of one.
    const last = at((h) => (h >= 64 ? 1510 : h >= 32 ? 1550 : h >= 16 ? 1700 : 1900));
    expect([last.a.hosts, last.a.noBetterFrom, last.sim.includes(64)]).toEqual([null, undefined, true]);
  });

  it('simulate_aHostLackingTheSnapshotWithFewChildren_migratesThem_andDoesNotBecomeAHolder', () => {
    // One template, single-child forks: each host it lands on lacking the snapshot migrates
    // the child (executor's migrates(): at most 2 children, at most 4 such hosts) and still
    // lacks it after (ADR 0015 item 5). Before, the first such child made the host a holder,
    // so copies spread until nearly every child was same-host (cross-host fraction 0.02).
    const model: LatencyModel = { sameHostMs: [100], transferMsAtRun: 500, wireMsAtRun: 500, runLinkGbps: 10, runAccel: 'tcg', runDate: '', runGitCommit: '', guestMib: 256, source: 'test' };
    const s = simulate(model, 16, 10, { forksPerSecond: 30, slotsPerHost: 1, templates: 1, simulatedSeconds: 20, p95TargetMs: 1e9 });
    expect(s.crossHostFraction).toBeGreaterThan(0.5);
    const host: SimHost = { slotFree: [0, 0], copyAt: new Map() };
    expect(bookChild(host, 'tpl-0', 0, 100, 500, true)).toEqual({ readyAtMs: 600, onTransfer: true, migrated: true });
    expect(host.copyAt.has('tpl-0')).toBe(false);
    // Where the host does hold a complete copy, a child restores from it.
    host.copyAt.set('tpl-0', 0);
    expect(bookChild(host, 'tpl-0', 10, 100, 500, true)).toEqual({ readyAtMs: 110, onTransfer: false });
  });

  it('modelFrom_pricesAFetchFromTheFourChildScenarios_andSaysWhatItUsed', () => {
    const four: RunResult = {
      ...run,
      scenarios: { ...run.scenarios, fork_same_host_4: { n: 4, p50_ms: 500, p95_ms: 600, p99_ms: 600, max_ms: 600 }, fork_cross_host_4: { n: 4, p50_ms: 1500, p95_ms: 1600, p99_ms: 1600, max_ms: 1600 } },
      phases: { fork_cross_host_4: { n: 1, op_ms: 0, to_first_step_ms: 0, host_step_ms: 0, step_overhead_ms: 0, exec_after_op_ms: 0, bytes_moved: 125e6, migrated_samples: 0 } },
    };
    const m = modelFrom(four);
    expect([m.fetchMsAtRun, m.fetchWireMsAtRun]).toEqual([1000, 100]);
    expect(fetchExtraMs(m, 1)).toBe(900 + 1000);
    expect(m.source).toMatch(/fetch extra \(fork_cross_host_4 - fork_same_host_4\) p50/);
    // Without them (or where that scenario migrated) a fetch costs what fork_cross_host_1 did, and the source says so.
    expect(fetchExtraMs(modelFrom(run), 10)).toBe(100);
    expect(modelFrom(run).source).toMatch(/fetch extra as the migration one/);
    const migrated4 = { ...four, phases: { fork_cross_host_4: { ...four.phases!.fork_cross_host_4!, migrated_samples: 1 } } };
    expect(modelFrom(migrated4).fetchMsAtRun).toBeUndefined();
  });

  it('modelFrom_fourChildSamplesThatFetchedAPartOfTheSnapshot_priceTheWireTimeOfAllOfIt', () => {
    // Each fork_cross_host_4 sample forks a fresh snapshot of the same template onto hosts that
    // hold most of its chunks from the sample before: here the median moved 12.5 MB of the
    // snapshot's 250 MB. Before, that part's extra (1000 ms, 10 ms of it wire) was the price
    // of every fetch, a cold one included.
    const fetched = (bytes: number, env: Partial<RunResult['env']> & { snapshot_stored_bytes?: number } = {}): RunResult => ({
      ...run,
      env: { ...run.env, ...env },
      scenarios: { ...run.scenarios, fork_same_host_4: { n: 4, p50_ms: 500, p95_ms: 600, p99_ms: 600, max_ms: 600 }, fork_cross_host_4: { n: 8, p50_ms: 1500, p95_ms: 1600, p99_ms: 1600, max_ms: 1600 } },
      phases: { fork_cross_host_4: { n: 2, op_ms: 0, to_first_step_ms: 0, host_step_ms: 0, step_overhead_ms: 0, exec_after_op_ms: 0, bytes_moved: bytes, migrated_samples: 0 } },
    });
    const m = modelFrom(fetched(12.5e6, { snapshot_stored_bytes: 250e6 }));
    // 990 ms as measured, plus 250 MB at the run's 10 Gbit/s (200 ms), which scales.
    expect(m.fetchMsAtRun).toBeCloseTo(990 + 200, 6);
    expect(m.fetchWireMsAtRun).toBeCloseTo(200, 6);
    expect(fetchExtraMs(m, 1)).toBeCloseTo(990 + 2000, 6);
    expect(m.source).toMatch(/wire part priced at the snapshot's whole 238\.4 MiB \(the run's samples moved a median of 11\.9 MiB/);
    // Samples that moved (nearly) all of it are taken as measured.
    expect(modelFrom(fetched(240e6, { snapshot_stored_bytes: 250e6 })).fetchMsAtRun).toBe(1000);
    // A run that does not record the snapshot's size: as measured, and the source says so.
    const older = modelFrom(fetched(12.5e6));
    expect(older.fetchMsAtRun).toBe(1000);
    expect(older.source).toMatch(/does not record its snapshot's size/);
  });

  it('formatPlan_namesTheRunTheModelIsFrom_itsAccelDateAndCommit', () => {
    // Before, neither the plan's JSON nor its text said which run (or accel) priced it.
    const dated: RunResult = { ...run, env: { ...run.env, accel: 'kvm', date: '2026-12-08T10:00:00.000Z', git_commit: 'abc1234+dirty' } };
    const model = modelFrom(dated);
    expect(JSON.parse(JSON.stringify(model))).toMatchObject({ runAccel: 'kvm', runDate: '2026-12-08T10:00:00.000Z', runGitCommit: 'abc1234+dirty' });
    const text = formatPlan({ request: { forksPerSecond: 1, p95TargetMs: 1000 }, model, answers: [] });
    expect(text).toMatch(/model from the run of 2026-12-08T10:00:00\.000Z \(git abc1234\+dirty, fleet accel kvm\): fork_same_host_1 samples/);
  });

  it('planCapacity_anOverloadedFleet_isNoAnswer_evenWhereAShortRunMeetsTheTarget', () => {
    // 1 host, 1 slot, 100 ms restores: 10 children/s at most. 11 forks/s queue without end;
    // over 20 s from an empty fleet p95 stayed under 2 s, and 1 host was the answer.
    const fast: RunResult = { ...run, scenarios: { fork_same_host_1: { n: 3, p50_ms: 100, p95_ms: 100, p99_ms: 100, max_ms: 100 }, fork_cross_host_1: { n: 3, p50_ms: 100, p95_ms: 100, p99_ms: 100, max_ms: 100 } }, samples: { fork_same_host_1: [100, 100, 100] } };
    // Without a warm-up, as then: with one, 1 host misses by simulation (p95 3316 ms) and the
    // test would pass without the check; here its simulated p95 is 1872 ms.
    const o = { forksPerSecond: 11, p95TargetMs: 2000, slotsPerHost: 1, templates: 1, warmUpSeconds: 0, linkRatesGbps: [10], maxHosts: 16 };
    expect(simulate(modelFrom(fast), 1, 10, o).p95Ms).toBeLessThanOrEqual(2000);
    expect(planCapacity(fast, o).answers[0]?.hosts).toBe(2);
  });

  it('planCapacity_aFleetWhoseMemoryFillsAfterTheFirstSeconds_isNoAnswer', () => {
    // Children live 30 s: a run of 20 s from an empty fleet never saw memory full (4 hosts
    // answered; over 60 s they left 206 children unplaced). Measured after the warm-up, the
    // answer places every child over 60 s too.
    const o = { forksPerSecond: 10, p95TargetMs: 1000, hostMemoryMib: 4096, templates: 5, linkRatesGbps: [10], maxHosts: 64 };
    const plan = planCapacity(run, o);
    const hosts = plan.answers[0]!.hosts!;
    expect(simulate(plan.model, hosts, 10, { ...o, simulatedSeconds: 60 }).unplaced).toBe(0);
  });

  it('simulate_defaultsToTheAgentsStepConcurrency_andThePlanSaysItIsAssumed', () => {
    const o = { forksPerSecond: 40, p95TargetMs: 1000, simulatedSeconds: 2, warmUpSeconds: 0, templates: 5 };
    expect(simulate(modelFrom(run), 4, 10, o)).toEqual(simulate(modelFrom(run), 4, 10, { ...o, slotsPerHost: 4 }));
    const text = formatPlan(planCapacity(run, { ...o, linkRatesGbps: [10], maxHosts: 16 }));
    expect(text).toMatch(/slots\/host 4,/);
    expect(text).toMatch(/FF_STEP_CONCURRENCY/);
    expect(text).toMatch(/p95 per child/);
  });

  it('planCapacity_aTargetBelowTheRunsSameHostP95_failsNamingTheFlag', () => {
    // Before: every link rate answered "> 8192", which reads as "buy more hosts".
    expect(() => planCapacity(run, { forksPerSecond: 5, p95TargetMs: 250, maxHosts: 4 })).toThrow(/^--p95-ms: 250 ms is below the run's same-host p95 \(260 ms/);
  });

  it('planCapacity_aBadOption_failsNamingItsFlag', () => {
    const o = { forksPerSecond: 5, p95TargetMs: 1000, maxHosts: 2, linkRatesGbps: [10] };
    const cases: Array<[Partial<PlanOptions>, RegExp]> = [
      [{ simulatedSeconds: 0 }, /^--seconds: want a number > 0, got 0/],
      [{ simulatedSeconds: Number.NaN }, /^--seconds:/],
      [{ simulatedSeconds: -5 }, /^--seconds:/],
      [{ childrenPerFork: 0 }, /^--fork-n: want an integer >= 1, got 0/],
      [{ childrenPerFork: 2.5 }, /^--fork-n:/],
      [{ slotsPerHost: 0 }, /^--host-slots: want an integer >= 1/],
      [{ forksPerSecond: 0 }, /^--forks-per-s: want a number > 0, got 0/],
      [{ forksPerSecond: Number.POSITIVE_INFINITY }, /^--forks-per-s: want a number > 0, got Infinity/],
      [{ p95TargetMs: Number.NaN }, /^--p95-ms:/],
      [{ linkRatesGbps: [] }, /^linkRatesGbps:/],
      // Too many children to simulate: named by the flags given, whichever made it so.
      [{ simulatedSeconds: 1e6 }, /^--forks-per-s, --seconds: want at most 1000000 children/],
      [{ forksPerSecond: 1e5, childrenPerFork: 4 }, /^--forks-per-s, --fork-n: want at most 1000000 children/],
    ];
    for (const [bad, msg] of cases) expect(() => planCapacity(run, { ...o, ...bad }), JSON.stringify(bad)).toThrow(msg);
  });

  it('modelFrom_aStoppedOrMissingSameHostScenario_saysWhy_andMissingSamplesAreNamedInTheSource', () => {
    expect(() => modelFrom({ ...run, scenarios: { ...run.scenarios, fork_same_host_1: { ...(run.scenarios.fork_same_host_1 as object), truncated: '1 of 5 samples' } as never } })).toThrow(/no complete fork_same_host_1 \(stopped early: 1 of 5/);
    expect(modelFrom({ ...run, samples: {} }).source).toMatch(/fork_same_host_1 p50 as every restore \(the run has no samples\)/);
    expect(() => modelFrom({} as RunResult)).toThrow(/^--from: not a load-test run/);
  });

  it('pickTemplate_reachesEveryTemplate_theFirstMostOften', () => {
    const seen = new Map<number, number>();
    for (let i = 0; i < 10_000; i++) {
      const k = pickTemplate(5, i / 10_000);
      seen.set(k, (seen.get(k) ?? 0) + 1);
    }
    expect([...seen.keys()].sort()).toEqual([0, 1, 2, 3, 4]);
    expect(seen.get(0)!).toBeGreaterThan(seen.get(4)!);
    expect(pickTemplate(5, 0.999999)).toBe(4);
    expect(pickTemplate(1, 0.999999)).toBe(0);
  });
});
