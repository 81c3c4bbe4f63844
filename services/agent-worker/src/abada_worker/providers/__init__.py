"""Model providers behind one interface (`base.ModelProvider`); Gemini through google-genai first."""
