"""SGLang's native API (/generate and friends) mapped onto the engine."""
