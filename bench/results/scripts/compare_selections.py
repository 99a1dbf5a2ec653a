# Fraction of (head, query) selection rows whose block sets differ between two `msa op indexer`
# outputs, and of selected blocks. Usage: compare_selections.py A.safetensors B.safetensors
import json, struct, sys, array
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); d=b[8+n:]
    out={}
    for k,v in h.items():
        if k=='__metadata__': continue
        s,e=v['data_offsets']; a=array.array('i' if v['dtype']=='I32' else 'f'); a.frombytes(d[s:e]); out[k]=(v['shape'],a)
    return out
a=load(sys.argv[1]); b=load(sys.argv[2])
shape,ta=a['topk']; _,tb=b['topk']; k=shape[-1]; rows=len(ta)//k
diff=0; slotdiff=0
for r in range(rows):
    sa=set(ta[r*k:(r+1)*k]); sb=set(tb[r*k:(r+1)*k])
    if sa!=sb: diff+=1; slotdiff+=len(sa-sb)
print(f"rows {rows}: {100*diff/rows:.2f}% of rows select another set; {100*slotdiff/(rows*k):.3f}% of selected blocks differ")
