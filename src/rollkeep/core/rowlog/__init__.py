"""Layer 4, the row log (RUN_DIR/rows): append-only segments holding every sealed row once,
read by location (`segments`), and the writer that appends and fsyncs them (`writer`)."""
