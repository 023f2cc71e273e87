"""tracecar collector: receive → validate → sample → decode → spool → forward."""
