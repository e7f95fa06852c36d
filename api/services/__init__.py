"""Operations every protocol shares (Tinker, Twinkle, OpenAI, the console): route modules call these, never
each other, so a protocol's routes hold only what is particular to that protocol."""
