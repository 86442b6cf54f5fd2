"""The coordinator's read-only web dashboard (`edge-coordinator serve --ui ADDR`)."""
