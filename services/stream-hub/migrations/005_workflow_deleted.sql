-- A run whose workflow was soft-deleted (RunTransition.workflow_deleted, from DeleteWorkflow):
-- spec, its runs "become UNDISCOVERABLE through the workflow", and StreamVisibleRuns lists only
-- "the runs whose parent workflow the CALLER may see". The snapshot of the visible set leaves
-- such runs out; by run id (StreamRunStatus, StreamRunLogs, StreamNodeIO, GetNodeTranscript)
-- they stay readable. Set once, never cleared (a soft delete is not undone).
ALTER TABLE runs ADD COLUMN workflow_deleted boolean NOT NULL DEFAULT false;
