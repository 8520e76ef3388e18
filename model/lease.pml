/*
 * The relay's lease protocol, as relay/ runs it, for Spin (model/README.md).
 *
 * 3 replicas, each with a lane per shard of its RELAY_SHARDS (1 or 2): one lease row
 * "g" for one shard (L0), "g#0/2" and "g#1/2" for two (L1, L2), one lease group. Three
 * outbox rows: 0 and 1 of key a, 2 of key b; with two shards key a is shard 0 (L1),
 * key b shard 1 (L2); with one shard every row is L0's.
 *
 * Time is the database's now(), in ticks: every timestamp is kept as the ticks left
 * until it passes (expires_at - now(), a local deadline - now, next_attempt_at - now),
 * so time may run forever in a finite state space. A replica's monotonic clock is
 * only ever compared with its own earlier readings, so its offset cancels out: its
 * deadline is kept in the same ticks (drift is what RELAY_LEASE_MARGIN covers; here it
 * is not modelled). Any process may be left unscheduled while the clock ticks: that
 * is a pause (GC, SIGSTOP, a slow network) of any length.
 *
 * Every step names the statements of relay/sql/ it stands for, with a fingerprint of
 * the text relay/sql/__init__.py loads (tests/test_model.py holds them to it):
 *     sql: <file> <statement> sha256:<first 16 hex digits>
 * and says which isolation it relies on. A step is one atomic Spin step when
 * PostgreSQL makes it atomic: one statement, or one transaction whose first statement
 * locks the rows the rest depends on.
 *
 * Switches: -DLIVENESS (the liveness run: faults stop, the claim below is checked
 * under weak fairness), and one -DMUTANT_* (model/README.md, "Mutants").
 */

#ifndef TTL
#define TTL     2   /* RELAY_LEASE_TTL_SECONDS, in ticks */
#endif
#define MARGIN  1   /* Lease.margin: the local deadline is ttl - margin after `started` */
#define BACKOFF 1   /* next_attempt_at - now() after a transient failure */
#ifndef EMAX
#define EMAX    3   /* bound: epochs of a lease row (acquisitions and fencings) */
#endif

#ifndef CRASHES
#define CRASHES 1   /* crashes (with a restart), of any replica at any moment */
#endif
#ifndef RECOUNTS
#define RECOUNTS 0  /* restarts with the other RELAY_SHARDS (a rolling change) */
#endif
#ifndef SINK_FAULTS
#define SINK_FAULTS 2 /* publications the sink fails or delays (a straggler) */
#endif
#ifndef LET_GOS
#define LET_GOS 1   /* give-ways and hand-overs of a surplus shard */
#endif
#ifndef PAUSE_TICKS
#define PAUSE_TICKS 6 /* liveness run only: ticks before the faults stop */
#endif

#define NONE   0
#define UNSENT 0
#define SENT   1    /* settled: deleted (settle_delete_sent), moved (settle_move_sent) or marked (settle_mark_sent) */
#define DEAD   2    /* dead-lettered */

/* --- the database ------------------------------------------------------------------ */

/* leases: holder (replica + 1, 0 = NULL), epoch, expires_at - now()
 * (0: expired), released_at IS NOT NULL. */
byte lh[3];
byte le[3];
byte lr[3];
bit  lrel[3];
byte gcnt = 1;          /* lease_groups.shards: the count in force */

/* outbox: state, attempts (a second failure dead-letters: RELAY_MAX_ATTEMPTS 2),
 * next_attempt_at - now(). */
byte st[3];
bit  att[3];
byte bo[3];

/* --- the sink, as the world sees it -------------------------------------------------- */

bit landed[3];          /* the row has been delivered at least once */
bit disorder;           /* row 1 was first delivered before row 0 (both key a) */

/* --- each replica (lane = replica * 2 + slot; slot 1 only with two shards) ----------- */

byte cnt[3];            /* RELAY_SHARDS of each replica */
byte tok[6];            /* Lease._token's epoch (0: none) */
byte dl[6];             /* Lease._deadline - now (0: passed) */
byte prow[6];           /* the batch being settled: row + 1 (0: none) */
bit  pok[6];            /*   its outcome: acknowledged, or failed */
byte pep[6];            /*   the epoch it is settled under */
byte srow[6];           /* a straggler: row + 1, published, no outcome yet */
bit  sgot[6];           /*   it has landed (the sink's answer is due) */
byte sep[6];            /*   the term it was published in */
byte torel[6];          /* Lease._to_release: given up, the row not yet expired */
byte stage[6];          /* mutants only: a step between two halves of an acquisition */
byte sseen[6];          /* mutants only: the epoch that acquisition saw or took */
byte glock;             /* mutants only: lane + 1 holding lease_groups' row lock */

/* --- the environment ----------------------------------------------------------------- */

byte crashes = CRASHES;
byte recounts = RECOUNTS;
byte sinkf = SINK_FAULTS;
byte letgos = LET_GOS;
bit calm;               /* liveness run: the faults have stopped */
bit capped;             /* liveness run: an acquisition hit the epoch bound */

hidden byte L, j, K;

#define R(l)        ((l) / 2)
#define LS(l)       (((l) % 2 == 1) -> 2 : ((cnt[(l) / 2] == 1) -> 0 : 1))
#define C(l)        cnt[(l) / 2]
#define ACTIVE(l)   ((l) % 2 == 0 || cnt[(l) / 2] == 2)
#define CNT_OF(k)   (((k) == 0) -> 1 : 2)
#define KEY(i)      (((i) < 2) -> 0 : 1)
#define COVERS(k, i) ((k) == 0 || ((k) == 1 && KEY(i) == 0) || ((k) == 2 && KEY(i) == 1))
/* Lease.token(): held, and the local deadline not passed. */
#define TRUST(l)    (tok[l] != 0 && dl[l] > 0)

/* --- properties ---------------------------------------------------------------------- */

/* At most one replica trusts a lease covering any row, by the database's clock:
 * key a's rows are L0's or L1's, key b's are L0's or L2's. */
#define T1(l) ((TRUST(l) && LS(l) != 2) -> 1 : 0)
#define T2(l) ((TRUST(l) && LS(l) != 1) -> 1 : 0)
#define ONE_HOLDER \
    (T1(0) + T1(1) + T1(2) + T1(3) + T1(4) + T1(5) <= 1 && \
     T2(0) + T2(1) + T2(2) + T2(3) + T2(4) + T2(5) <= 1)
/* Key a's first deliveries are in id order, among rows settled. */
#define IN_ORDER    (!(disorder && st[0] == SENT && st[1] == SENT))
#define DONE        (st[0] != UNSENT && st[1] != UNSENT && st[2] != UNSENT)

inline deliver(i) {
    if
    :: !landed[i] && i == 1 && !landed[0] -> disorder = 1
    :: else -> skip
    fi;
    landed[i] = 1
}

/* --- the acquisition: relay/store/lease.py try_acquire, one REPEATABLE READ
 * transaction on the elector's session (relay/store/postgres.py PostgresLeaseStore).
 *   sql: lease.sql lease_group_claim sha256:27c9a6ef47701a86
 *   sql: lease.sql lease_read sha256:604e5baf2784d96d
 *   sql: lease.sql lease_take sha256:3094ea547ca91b11
 * Its first statement updates the group's row, so acquisitions of the group run one
 * at a time (a concurrent one waits for the lock, then fails with 40001). Its
 * snapshot is taken there: a lease row it reads and then writes that another session
 * wrote since (a renewal, a settle's fence, a release) makes the write fail with 40001
 * (first updater wins). Whatever it read is therefore still true when it commits, so
 * it is one atomic step; the claim commits even when the take is not made
 * (HeldByOther returns inside the transaction). */

#define LIVE_OTHER(c) \
    ((CNT_OF(0) != (c) && lh[0] != 0 && !lrel[0] && lr[0] > 0) || \
     (CNT_OF(1) != (c) && lh[1] != 0 && !lrel[1] && lr[1] > 0) || \
     (CNT_OF(2) != (c) && lh[2] != 0 && !lrel[2] && lr[2] > 0))
#define FENCEABLE(c) \
    ((CNT_OF(0) != (c) && lh[0] != 0) || (CNT_OF(1) != (c) && lh[1] != 0) || \
     (CNT_OF(2) != (c) && lh[2] != 0))
#define FENCE_FITS(c) \
    (!((CNT_OF(0) != (c) && lh[0] != 0 && le[0] >= EMAX) || \
       (CNT_OF(1) != (c) && lh[1] != 0 && le[1] >= EMAX) || \
       (CNT_OF(2) != (c) && lh[2] != 0 && le[2] >= EMAX)))
#ifdef MUTANT_NO_COUNT_CHECK
#define CLAIMABLE(c) 1
#else
/* claimed: g.shards = ours OR NOT EXISTS (live_other) */
#define CLAIMABLE(c) (gcnt == (c) || !LIVE_OTHER(c))
#endif
/* lease_read: live (expires_at > now()) and another holder: HeldByOther */
#define HELD(l)     (lr[LS(l)] > 0 && lh[LS(l)] != R(l) + 1)
#define TAKEABLE(l) (!HELD(l) && le[LS(l)] < EMAX)
/* Only attempts that change something are steps: one that finds the lease held and
 * the count in force changes nothing (the same state). */
#define USEFUL(l) \
    (CLAIMABLE(C(l)) && FENCE_FITS(C(l)) && (gcnt != C(l) || FENCEABLE(C(l)) || TAKEABLE(l)))

inline claim(c) {
    /* lease_group_claim: the count becomes ours; a change fences every lease of the
     * other count still held (epoch + 1, holder NULL, expired, released). */
    gcnt = c;
    K = 0;
    do
    :: K < 3 ->
        if
        :: CNT_OF(K) != c && lh[K] != 0 ->
            le[K]++; lh[K] = 0; lr[K] = 0; lrel[K] = 1
        :: else -> skip
        fi;
        K++
    :: else -> break
    od
}

inline take(l) {
    /* lease_take: holder = us, epoch + 1, expires_at = now() + ttl, released_at NULL */
    L = LS(l);
    le[L]++; lh[L] = R(l) + 1; lr[L] = TTL; lrel[L] = 0
}

inline acquire(l) {
    atomic {
        tok[l] == 0 && torel[l] == 0 && stage[l] == 0 && ACTIVE(l) && glock == 0 &&
        USEFUL(l) ->
        claim(C(l));
        if
        :: TAKEABLE(l) ->
#if defined(MUTANT_NO_EPOCH_CHECK)
            /* Mutant: the take is not a compare-and-swap (no `epoch = seen`, no
             * snapshot of REPEATABLE READ to fail it): it is made later, in a step of
             * its own, whatever happened to the row since lease_read. */
            sseen[l] = le[LS(l)]; stage[l] = 2; glock = l + 1
#elif defined(MUTANT_LATE_DEADLINE)
            /* Mutant: `started` is read after the acquiring transaction, not before. */
            take(l); sseen[l] = le[L]; stage[l] = 1
#else
            /* Elector._attempt: `started` read before the transaction; then
             * Lease.acquired: deadline = started + ttl - margin. */
            take(l); tok[l] = le[L]; dl[l] = TTL - MARGIN
#endif
        :: else -> skip
        fi
    }
}

inline acquire_rest(l) {
#if defined(MUTANT_NO_EPOCH_CHECK)
    atomic { stage[l] == 2 -> take(l); tok[l] = le[L]; dl[l] = TTL - MARGIN;
             stage[l] = 0; glock = 0 }
#elif defined(MUTANT_LATE_DEADLINE)
    atomic { stage[l] == 1 -> tok[l] = sseen[l]; dl[l] = TTL - MARGIN; stage[l] = 0 }
#else
    atomic { false -> skip }
#endif
}

/* --- the elector's other steps (relay/lease/elector.py Elector.turn) ----------------------- */

/* The fence: lease_renew's WHERE, word for word the settles' `fence` fragment. */
#define FENCE_OK(L, r, e) (lh[L] == (r) + 1 && le[L] == (e) && !lrel[L])

inline renew(l) {
    /* Elector._keep: renew once the local deadline is near (since_renewal >=
     * renew_interval: here, one tick before it passes); zero rows: a newer holder exists, lose the lease. One statement,
     * autocommit; its row lock orders it with the acquisition's take (40001 there).
     *   sql: lease.sql lease_renew sha256:8295e139e4aff8bc */
    atomic {
        tok[l] != 0 && dl[l] == 1 && torel[l] == 0 &&
        (lr[LS(l)] < TTL || !FENCE_OK(LS(l), R(l), tok[l])) ->
        L = LS(l);
        if
        :: FENCE_OK(L, R(l), tok[l]) -> lr[L] = TTL; dl[l] = TTL - MARGIN
        :: else -> tok[l] = 0; dl[l] = 0
        fi
    }
}

inline expire(l) {
    /* Elector._expire_if_past_deadline: no database; the token is forgotten. */
    atomic { tok[l] != 0 && dl[l] == 0 -> tok[l] = 0 }
}

inline release(l) {
    /* Elector.turn: the term given up is expired in its row, before any campaign.
     * One statement, autocommit.
     *   sql: lease.sql lease_release sha256:de3ab76d489fee99
     * Property: a term is released only once nothing published under it is still to
     * be settled or to land (the last settle landed, the sink's stragglers dropped). */
    atomic {
        torel[l] != 0 ->
        assert((prow[l] == 0 || pep[l] != torel[l]) && (srow[l] == 0 || sep[l] != torel[l])); /* property: clean hand-over */
        L = LS(l);
        if
        :: lh[L] == R(l) + 1 && le[L] == torel[l] -> lr[L] = 0; lrel[L] = 1
        :: else -> skip
        fi;
        torel[l] = 0
    }
}

/* --- the drain loop (relay/drain/loop.py Drainer, relay/drain/pipeline.py) ---------------------- */

/* A row the fetch gives this lane (fetch_head / fetch_batch, one READ COMMITTED
 * statement; with RELAY_FAIRNESS=off, fetch_head's windows in one REPEATABLE READ
 * snapshot, so the same one view; the rows it reads are only ever settled under a
 * fence, so a stale read costs a duplicate, never more):
 *   sql: drain.sql fetch_head sha256:7655fb1b4e0e74ed
 *   sql: drain.sql fetch_batch sha256:6b7855121426556a
 * unsent, in this lane's shard, not in flight here (`in_flight`, by id or span), not
 * in a backoff (`ready`), and the first such row of its key: an earlier unsent row of the key is
 * fetched first, one in a backoff holds it back (`ready`), one in flight here without
 * an acknowledgement holds it back (`held`: SettlePipeline.unsettled). */
#ifdef MUTANT_NO_KEY_HOLD
/* Mutant: the loop does not hold back the key of a straggler. */
#define EARLIER_OK(l, i) ((i) != 1 || st[0] != UNSENT || srow[l] == 1)
#else
#define EARLIER_OK(l, i) ((i) != 1 || st[0] != UNSENT)
#endif
#define ELIG(l, i) \
    (st[i] == UNSENT && bo[i] == 0 && COVERS(LS(l), i) && srow[l] != (i) + 1 && \
     EARLIER_OK(l, i))

inline publish(l) {
    /* Drainer._step: fetch a batch (here one row), publish it, hand its outcome to
     * the settler: the first row the fetch returns, in id order. The sink acknowledges (the row is delivered), fails it (a retry:
     * delivered or not, the relay cannot tell), or gives no answer yet (a straggler:
     * delivered later, or dropped by Sink.reset). The batch before it has landed. */
    atomic {
        TRUST(l) && prow[l] == 0 && (srow[l] == 0 || sep[l] == tok[l]) &&
        (ELIG(l, 0) || ELIG(l, 1) || ELIG(l, 2)) ->
        if
        :: ELIG(l, 0) -> j = 0
        :: !ELIG(l, 0) && ELIG(l, 1) -> j = 1
        :: !ELIG(l, 0) && !ELIG(l, 1) -> j = 2
        fi;
        if
        :: deliver(j); prow[l] = j + 1; pok[l] = 1; pep[l] = tok[l]
        :: sinkf > 0 && !calm -> sinkf--; prow[l] = j + 1; pok[l] = 0; pep[l] = tok[l]
        :: sinkf > 0 && !calm && srow[l] == 0 ->
            sinkf--; srow[l] = j + 1; sgot[l] = 0; sep[l] = tok[l]
        fi
    }
}

inline straggler(l) {
    atomic {
        /* The sink delivers a straggler, at any time until it is dropped. */
        srow[l] != 0 && !sgot[l] -> deliver(srow[l] - 1); sgot[l] = 1
    }
}

inline answered(l) {
    /* Drainer._nothing_to_publish: the straggler's answer came; settle it. */
    atomic {
        TRUST(l) && tok[l] == sep[l] && srow[l] != 0 && sgot[l] && prow[l] == 0 ->
        prow[l] = srow[l]; pok[l] = 1; pep[l] = tok[l]; srow[l] = 0; sgot[l] = 0
    }
}

inline drain_ends(l) {
    /* Drainer.drain's `finally`: the term is over; drop_stragglers and Sink.reset. */
    atomic {
        srow[l] != 0 && !(TRUST(l) && tok[l] == sep[l]) -> srow[l] = 0; sgot[l] = 0
    }
}

inline let_go(l) {
    /* HandOver._let_go (give_way, rebalance): land_quietly (the last settle lands),
     * drop the stragglers, Sink.reset, Lease.give_up; the elector releases the row. */
    atomic {
        TRUST(l) && letgos > 0 && !calm &&
#ifndef MUTANT_EARLY_RELEASE
        prow[l] == 0 &&
#endif
        true ->
        letgos--; srow[l] = 0; sgot[l] = 0; torel[l] = tok[l]; tok[l] = 0; dl[l] = 0
    }
}

/* --- the settler (relay/drain/settler.py, relay/store/repository.py settle) ---------------------- */

#ifdef MUTANT_NO_FENCE
/* Mutant: the settle's writes do not wait for the fence to return a row. */
#define COMMITS(l) true
#else
#define COMMITS(l) FENCE_OK(LS(l), R(l), pep[l])
#endif

inline settle(l) {
    /* One atomic step on the settle session (READ COMMITTED, autocommit). Acknowledged
     * rows: one statement, the fence as a CTE and the delete (or the move into
     * outbox_sent, or the mark) only if it returned a row:
     *   sql: drain.sql settle_delete_sent sha256:f835f77fd2cc3cbe
     *   sql: drain.sql settle_move_sent sha256:9674552d080e20ac
     *   sql: drain.sql settle_mark_sent sha256:990bf53b5b9f2396
     * A failed row: one transaction whose first statement is the fence (its row lock
     * held to the commit: a take waits for it, then fails with 40001), then the
     * failure or the dead letter (and, in a batch of several rows, the acknowledged
     * ones deleted or marked); zero rows from the fence rolls it all back:
     *   sql: lease.sql lease_renew sha256:8295e139e4aff8bc
     *   sql: drain.sql record_failures sha256:6a5731a2224e1277
     *   sql: drain.sql delete_sent sha256:6343f8ccd3f028ac
     *   sql: drain.sql move_sent sha256:b914670553429ab0
     *   sql: drain.sql mark_sent sha256:1d057c0e2de7e618
     *   sql: drain.sql dead_letter sha256:30cd1fed2a46f1fe
     *   sql: drain.sql dead_letter_move sha256:98b7eab443805080
     * (the dead letter marked in place, or moved into outbox_dead: either way it
     * leaves the drain, DEAD here.) A dead letter over 16 MiB is moved after that
     * transaction, in one of its own that takes the fence first as well, the row in
     * flight meanwhile: for that row, this step is that second transaction, the first
     * having written nothing of it:
     *   sql: drain.sql dead_letter_move_rest sha256:d8b25db94e55cf2b
     * A settle that holds renews the lease (Settler._settle: Lease.renewed); one fenced
     * out drops it (Lease.fenced). */
    atomic {
        prow[l] != 0 ->
        L = LS(l); j = prow[l] - 1;
        if
        :: COMMITS(l) ->
            /* Property: it commits only under the epoch holding the row's shard now. */
            assert(FENCE_OK(L, R(l), pep[l]) && gcnt == CNT_OF(L)); /* property: fenced settle */
            /* Property: no row is settled twice, none settled undelivered. */
            assert(st[j] == UNSENT); /* property: settled once */
            if
            :: pok[l] -> assert(landed[j]); st[j] = SENT /* property: nothing lost */
            :: !pok[l] && att[j] -> st[j] = DEAD
            :: !pok[l] && !att[j] -> att[j] = 1; bo[j] = BACKOFF
            fi;
            lr[L] = TTL;
            if
            :: tok[l] == pep[l] -> dl[l] = TTL - MARGIN
            :: else -> skip
            fi
        :: else ->
            if
            :: tok[l] == pep[l] -> tok[l] = 0; dl[l] = 0
            :: else -> skip
            fi
        fi;
        prow[l] = 0; pok[l] = 0; pep[l] = 0
    }
}

#ifdef LIVENESS
inline out_of_bounds(l) {
    /* An acquisition the epoch bound stops: the run leaves the bounds. */
    atomic {
        !capped && tok[l] == 0 && torel[l] == 0 && stage[l] == 0 && ACTIVE(l) &&
        CLAIMABLE(C(l)) && (!FENCE_FITS(C(l)) || (!HELD(l) && le[LS(l)] >= EMAX)) ->
        capped = 1
    }
}
#else
inline out_of_bounds(l) { atomic { false -> skip } }
#endif

inline lane(l) {
    if
    :: acquire(l)
    :: acquire_rest(l)
    :: renew(l)
    :: expire(l)
    :: release(l)
    :: publish(l)
    :: straggler(l)
    :: answered(l)
    :: drain_ends(l)
    :: let_go(l)
    :: settle(l)
    :: out_of_bounds(l)
    fi
}

/* A replica: its elector, drain loop and settler threads, for each of its lanes, as
 * one process; the interleaving of their steps is any, and leaving the process
 * unscheduled pauses all of them at once. */
proctype Replica(byte r) {
    do
    :: lane(r * 2)
    :: lane(r * 2 + 1)
    od
}

/* --- faults and the clock ------------------------------------------------------------ */

inline tick() {
    d_step {
        K = 0;
        do
        :: K < 3 ->
            if :: lr[K] > 0 -> lr[K]-- :: else -> skip fi;
            if :: bo[K] > 0 -> bo[K]-- :: else -> skip fi;
            K++
        :: else -> break
        od;
        K = 0;
        do
        :: K < 6 -> if :: dl[K] > 0 -> dl[K]-- :: else -> skip fi; K++
        :: else -> break
        od;
        K = 0
    }
}

inline crash(r) {
    /* The process dies (SIGKILL, OOM) and starts again: its local state is gone, its
     * open transactions roll back, its sink's queue is lost. */
    d_step {
        K = r * 2;
        do
        :: K < r * 2 + 2 ->
            tok[K] = 0; dl[K] = 0; prow[K] = 0; pok[K] = 0; pep[K] = 0; srow[K] = 0;
            sgot[K] = 0; sep[K] = 0; torel[K] = 0; stage[K] = 0; sseen[K] = 0;
            if :: glock == K + 1 -> glock = 0 :: else -> skip fi;
            K++
        :: else -> break
        od;
        K = 0
    }
}

active proctype Env() {
    byte r;
#ifdef LIVENESS
    byte ticks = PAUSE_TICKS;
#endif
    cnt[0] = 1; cnt[1] = 2; cnt[2] = 2;
#ifdef ONE_COUNT
    cnt[0] = 2;
#endif
    atomic { run Replica(0); run Replica(1); run Replica(2) }
    do
#ifdef LIVENESS
    :: ticks > 0 -> ticks--; tick()
#else
    :: tick()
#endif
    :: crashes > 0 ->
        atomic {
            crashes--;
            if :: r = 0 :: r = 1 :: r = 2 fi;
            crash(r); r = 0
        }
    :: recounts > 0 ->
        atomic {
            recounts--;
            if :: r = 0 :: r = 1 :: r = 2 fi;
            crash(r); cnt[r] = 3 - cnt[r]; r = 0
        }
#ifdef LIVENESS
    :: atomic { calm = 1; crashes = 0; recounts = 0; sinkf = 0; letgos = 0 } -> break
#endif
    od;
#ifdef LIVENESS
    /* The faults have stopped: time passes only when no replica has a step to take
     * (no more pauses), so every replica renews in time and waits for what must
     * expire. */
end_calm:
    do
    :: timeout -> tick()
    od
#endif
}

#ifdef LIVENESS
/* Every row is eventually settled or dead-lettered, in every fair run within bounds. */
ltl eventually_done { <> (DONE || capped) }
#else
active proctype OneHolder() {
    atomic { !ONE_HOLDER -> assert(ONE_HOLDER) } /* property: one holder per row */
}

active proctype InOrder() {
    atomic { !IN_ORDER -> assert(IN_ORDER) } /* property: per-key order */
}
#endif
