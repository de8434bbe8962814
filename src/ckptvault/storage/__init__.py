"""Where bytes live and how a generation becomes visible."""
