-- The end of each run's contiguous prefix, kept by the projector instead of recomputed by every
-- snapshot.
--
-- A StreamRunStatus/StreamRunLogs snapshot covers only the seqs without a hole below them (the
-- end of the run's first contiguous block); the rest comes from the store or live once the hole
-- is filled. Computing that end from run_events on every snapshot costs a scan of the whole
-- run (tens of milliseconds for a run of 15,000 events), paid by every subscriber: hundreds of
-- subscribers of a long run queue their snapshots behind each other. The projector keeps it in
-- the run row instead, in the transaction that inserts the event, under the row lock the run
-- upsert takes, so concurrent replicas advance it one after the other:
--   first_seq   lowest seq projected for the run;
--   contig_seq  end of the block of consecutive seqs starting at first_seq.
-- NULL (rows projected before this migration): not known yet; readers compute it from
-- run_events, and the run's next event sets it.
ALTER TABLE runs ADD COLUMN first_seq bigint;
ALTER TABLE runs ADD COLUMN contig_seq bigint;
