"""The Batch API and the Files API: files in a directory or an S3-compatible bucket, batch records
in SQLite or Redis, input validation, and the runner that sends each line through the pipeline."""
