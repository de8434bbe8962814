"""Operations: drills, export, supervisor (later issues)."""
