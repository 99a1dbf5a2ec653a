# Writes one sequence of N random normal index inputs (qi [N,4,128], ki [N,128], f32, seed 7)
# as safetensors for `msa op indexer`. Usage: index_inputs_8k.py N OUT.safetensors
import json, struct, random, array, sys
N=int(sys.argv[1]); Hi=4; Di=128
random.seed(7)
def t(name, dtype, shape, data): return name, dtype, shape, data
qi=array.array('f',(random.gauss(0,1) for _ in range(N*Hi*Di)))
ki=array.array('f',(random.gauss(0,1) for _ in range(N*Di)))
cu=array.array('i',[0,N])
tensors=[('qi','F32',[N,Hi,Di],qi.tobytes()),('ki','F32',[N,Di],ki.tobytes()),('cu_seqlens_q','I32',[2],cu.tobytes()),('cu_seqlens_k','I32',[2],cu.tobytes())]
hdr={}; off=0; blob=b''
for n,d,s,b in tensors:
    hdr[n]={'dtype':d,'shape':s,'data_offsets':[off,off+len(b)]}; off+=len(b); blob+=b
h=json.dumps(hdr).encode(); h+=b' '*((8-len(h)%8)%8)
open(sys.argv[2],'wb').write(struct.pack('<Q',len(h))+h+blob)
