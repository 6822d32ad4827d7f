//! The 7B weight shapes that the weight-publishing examples and benchmarks share.

/// Names and shapes of the weights of a 7B Llama-style transformer (291 tensors; 13.5 GB in
/// bf16): what a trainer publishes to its rollout engines.
pub fn llama7b_shapes() -> Vec<(String, Vec<usize>)> {
    let (vocab, d, ff, layers) = (32000, 4096, 11008, 32);
    let mut v = vec![("model.embed_tokens.weight".to_string(), vec![vocab, d])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            v.push((format!("{p}.self_attn.{n}.weight"), vec![d, d]));
        }
        v.push((format!("{p}.mlp.gate_proj.weight"), vec![ff, d]));
        v.push((format!("{p}.mlp.up_proj.weight"), vec![ff, d]));
        v.push((format!("{p}.mlp.down_proj.weight"), vec![d, ff]));
        v.push((format!("{p}.input_layernorm.weight"), vec![d]));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
    }
    v.push(("model.norm.weight".to_string(), vec![d]));
    v.push(("lm_head.weight".to_string(), vec![vocab, d]));
    v
}
