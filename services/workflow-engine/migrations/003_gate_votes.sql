-- N of M approval gates (min_approvals): the distinct members who approved so far. The gate is
-- approved when their number reaches min_approvals; each vote is a conditional UPDATE of a
-- pending row under the run's lock, so a member is counted once.
ALTER TABLE governance ADD COLUMN approvers text[] NOT NULL DEFAULT '{}';
